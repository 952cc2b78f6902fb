"""Image tokens that see their whole image (Gemma 3): attention metadata's key_ends, on the
reference backend and the CPU kernels, against transformers' own mask functions and an explicit
softmax per query."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dabba.attention.torch_ref import window_mask
from dabba.ops.native import load_cpu_ops
from tests.attention.test_backends import run_both_backends, three_requests

QUERY_LENS, CONTEXT_LENS = [1, 40, 1, 37], [70, 9, 130, 0]
# image blocks (first position, end) per request, within its step's tokens: across tiles and blocks
IMAGES = {1: [(12, 30), (31, 34)], 3: [(0, 5), (20, 37)]}


def key_ends(query_lens: list[int], context_lens: list[int], images: dict[int, list[tuple[int, int]]]) -> np.ndarray:
    ends = []
    for r, (n, c) in enumerate(zip(query_lens, context_lens)):
        row = np.arange(c, c + n) + 1
        for first, end in images.get(r, []):
            row[first - c:end - c] = end
        ends.append(row)
    return np.concatenate(ends).astype(np.int64)


def test_reference_mask_is_transformers_vision_mask() -> None:
    """window_mask with key_ends equals transformers' Gemma 3 composition: full layers OR(causal,
    blockwise); sliding layers AND(sliding window, OR(causal, blockwise))."""
    from transformers.masking_utils import (and_masks, blockwise_overlay, causal_mask_function, or_masks,
                                            sliding_window_overlay)

    context, seq_len = 4, 30
    blocks = torch.full((1, seq_len), -1)
    blocks[0, 6:14], blocks[0, 20:26] = 0, 1
    ends = key_ends([seq_len - context], [context], {0: [(6, 14), (20, 26)]})
    q, kv = torch.arange(context, seq_len)[:, None], torch.arange(seq_len)[None, :]
    causal_or_block = or_masks(causal_mask_function, blockwise_overlay(blocks))
    for window in (None, 3, 5, 40):
        fn = causal_or_block if window is None else and_masks(sliding_window_overlay(window), causal_or_block)
        expected = fn(torch.tensor(0), torch.tensor(0), q, kv)
        assert torch.equal(window_mask(context, seq_len, window, "cpu", torch.from_numpy(ends)), expected)


@pytest.mark.skipif(not load_cpu_ops(), reason="native CPU kernel cannot be built here")
@pytest.mark.parametrize("sliding_window", [None, 4, 16, 100])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(8, 4, 16), (8, 1, 32), (4, 4, 64)])
def test_cpu_backend_matches_reference_with_image_blocks(sliding_window, dtype, atol, num_heads, num_kv_heads,
                                                         head_dim) -> None:
    ends = key_ends(QUERY_LENS, CONTEXT_LENS, IMAGES)
    (ref, _, _), (got, _, _) = run_both_backends(dtype, num_heads, num_kv_heads, head_dim, 16, QUERY_LENS,
                                                 CONTEXT_LENS, sliding_window, key_ends=ends)
    torch.testing.assert_close(got, ref, atol=atol, rtol=0)
    (causal, _, _), _ = run_both_backends(dtype, num_heads, num_kv_heads, head_dim, 16, QUERY_LENS, CONTEXT_LENS,
                                          sliding_window)
    assert (causal - ref).abs().max() > 10 * atol  # the image blocks change the output


@pytest.mark.skipif(not load_cpu_ops(), reason="native CPU kernel cannot be built here")
def test_prompt_kernel_against_an_explicit_softmax_with_image_blocks() -> None:
    """float32, by hand: query i of a request sees keys up to its key_end - 1."""
    num_kv_heads, head_dim, num_heads = 2, 32, 6
    q, keys, values, table, seq_lens, qsl = three_requests(5, num_kv_heads, head_dim, num_heads)
    query_lens = np.diff(qsl.numpy())
    contexts = seq_lens.numpy() - query_lens
    images = {r: [(int(contexts[r]) + 1, int(contexts[r] + query_lens[r]) - 1)] for r in range(3) if query_lens[r] > 3}
    ends = torch.from_numpy(key_ends(list(query_lens), list(contexts), images))
    out = torch.empty_like(q)
    torch.ops.dabba_cpu.paged_attention(out, q, keys.transpose(2, 3).contiguous(), values, table, qsl, seq_lens, 0.3,
                                        key_ends=ends)
    expected = torch.empty_like(q)
    for s in range(3):
        n = int(seq_lens[s])
        k = keys[:, table[s]].reshape(num_kv_heads, -1, head_dim)[:, :n]
        v = values[:, table[s]].reshape(num_kv_heads, -1, head_dim)[:, :n]
        for t in range(int(qsl[s]), int(qsl[s + 1])):
            end = int(ends[t])
            for h in range(num_heads):
                kvh = h // (num_heads // num_kv_heads)
                p = torch.softmax((k[kvh, :end] @ q[t, h]) * 0.3, dim=0)
                expected[t, h] = p @ v[kvh, :end]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="key_ends"):
        bad = ends.clone()
        bad[-1] = int(seq_lens[-1]) + 1
        torch.ops.dabba_cpu.paged_attention(out, q, keys.transpose(2, 3).contiguous(), values, table, qsl, seq_lens,
                                            0.3, key_ends=bad)
