"""Every backend must match the reference backend on the same step: same writes, same outputs."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dabba.attention.backend import CommonAttentionMetadata
from dabba.attention.cpu import CpuBackend
from dabba.attention.torch_ref import TorchRefBackend, window_mask
from dabba.ops.native import load_cpu_ops

pytestmark = pytest.mark.skipif(not load_cpu_ops(), reason="native CPU kernel cannot be built here")


def make_step(query_lens, context_lens, block_size, num_blocks, seed=0):
    """A mixed step: decodes (query_len 1) and prefill chunks with and without context,
    each request on its own shuffled blocks."""
    rng = np.random.default_rng(seed)
    seq_lens = np.array(context_lens) + np.array(query_lens)
    blocks_needed = [-(-int(n) // block_size) for n in seq_lens]
    ids = rng.permutation(num_blocks)[: sum(blocks_needed)]
    table = np.zeros((len(seq_lens), max(blocks_needed)), dtype=np.int64)
    pos = 0
    for i, n in enumerate(blocks_needed):
        table[i, :n] = ids[pos:pos + n]
        pos += n
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    slots = []
    for i, (c, s) in enumerate(zip(context_lens, seq_lens)):
        p = np.arange(c, s)
        slots.append(table[i, p // block_size] * block_size + p % block_size)
    common = CommonAttentionMetadata(qsl, seq_lens.astype(np.int64), table, torch.from_numpy(np.concatenate(slots)),
                                     block_size, torch.device("cpu"))
    return common


def run_both_backends(dtype, num_heads, num_kv_heads, head_dim, block_size, query_lens, context_lens,
                      sliding_window=None, softcap=None, scale=None,
                      key_ends=None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One step on the reference and the CPU backend, each cache filled with the same earlier
    tokens (the same logical context in both layouts): per backend (output, keys, values), the
    caches' contents read back in table order. ``key_ends``: the metadata's (image blocks)."""
    torch.manual_seed(0)
    num_blocks = 80
    common = make_step(query_lens, context_lens, block_size, num_blocks)
    common.key_ends = key_ends
    T = sum(query_lens)
    q, k, v = (torch.randn(T, h, head_dim, dtype=dtype) for h in (num_heads, num_kv_heads, num_kv_heads))
    ctx_k = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype)
    ctx_v = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype)
    outs = []
    for backend in (TorchRefBackend(), CpuBackend()):
        cache = torch.zeros(backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype)
        key_cache, value_cache = backend.split_cache(cache)
        md_all = SimpleNamespace(slot_mapping=torch.arange(num_blocks * block_size))  # write_kv reads only the slots
        backend.write_kv(key_cache, value_cache, ctx_k.flatten(1, 2).transpose(0, 1),
                         ctx_v.flatten(1, 2).transpose(0, 1), md_all)
        out = backend.forward(q, k, v, cache, backend.build_metadata(common), scale or head_dim ** -0.5, sliding_window,
                              softcap)
        kg, vg = backend.gather_context(key_cache, value_cache, torch.arange(num_blocks))
        outs.append((out.float(), kg.reshape(num_kv_heads, -1, head_dim), vg.reshape(num_kv_heads, -1, head_dim)))
    return outs


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [
    (9, 3, 64, 16), (8, 1, 32, 16), (12, 2, 128, 16), (9, 9, 16, 16),  # query heads in groups of 3, 8, 6, 1
    (4, 2, 24, 16), (6, 6, 16, 8), (4, 1, 40, 32), (18, 2, 16, 16),  # per-head loops: other shapes, groups of 9
])
@pytest.mark.parametrize("query_lens, context_lens", [([1, 1, 37, 1, 5, 1], [70, 3, 0, 130, 40, 0]),
                                                      ([1, 1, 1], [70, 0, 130]),  # decodes only: the fast path
                                                      ([150, 1, 33], [0, 17, 260])],  # prompts of many tiles
                         ids=["mixed", "decodes", "long"])
def test_cpu_backend_matches_reference(dtype, atol, num_heads, num_kv_heads, head_dim, block_size, query_lens,
                                       context_lens) -> None:
    (ref, ref_k, ref_v), (got, got_k, got_v) = run_both_backends(dtype, num_heads, num_kv_heads, head_dim, block_size,
                                                                 query_lens, context_lens)
    assert torch.equal(ref_k, got_k) and torch.equal(ref_v, got_v), "the caches hold different keys/values"
    torch.testing.assert_close(got, ref, atol=atol, rtol=0)


def test_decode_kernel_against_explicit_softmax() -> None:
    """The kernel alone, on float32, against attention written out by hand."""
    torch.manual_seed(1)
    num_kv_heads, num_blocks, block_size, head_dim, num_heads = 2, 20, 16, 32, 6
    values = torch.randn(num_kv_heads, num_blocks, block_size, head_dim)
    keys = torch.randn(num_kv_heads, num_blocks, block_size, head_dim)
    table = torch.tensor([[3, 7, 1, 0], [19, 2, 0, 0]])
    seq_lens = torch.tensor([50, 17])
    q = torch.randn(2, num_heads, head_dim)
    out = torch.empty_like(q)
    torch.ops.dabba_cpu.paged_decode_attention(out, q, keys.transpose(2, 3).contiguous(), values, table, seq_lens, 0.3)
    for s in range(2):
        n = int(seq_lens[s])
        k = keys[:, table[s]].reshape(num_kv_heads, -1, head_dim)[:, :n]
        v = values[:, table[s]].reshape(num_kv_heads, -1, head_dim)[:, :n]
        for h in range(num_heads):
            kvh = h // (num_heads // num_kv_heads)
            p = torch.softmax((k[kvh] @ q[s, h]) * 0.3, dim=0)
            torch.testing.assert_close(out[s, h], p @ v[kvh], atol=1e-5, rtol=1e-5)


def three_requests(seed: int, num_kv_heads: int, head_dim: int, num_heads: int):
    """The kernels' explicit-softmax cases, float32: in a cache of 20 blocks of 16, a 23-token chunk
    continuing a 27-token context, a decode at position 16 and a 64-token prompt.
    Returns q [88, heads, d], keys and values [kv_heads, blocks, 16, d], the block table,
    seq_lens and query_start_loc."""
    torch.manual_seed(seed)
    values = torch.randn(num_kv_heads, 20, 16, head_dim)
    keys = torch.randn(num_kv_heads, 20, 16, head_dim)
    table = torch.tensor([[3, 7, 1, 0], [19, 2, 0, 0], [5, 6, 8, 9]])
    q = torch.randn(88, num_heads, head_dim)
    return q, keys, values, table, torch.tensor([50, 17, 64]), torch.tensor([0, 23, 24, 88])


def test_prompt_kernel_against_explicit_causal_softmax() -> None:
    """paged_attention alone, on float32: two prompts continuing their contexts, and a decode."""
    num_kv_heads, head_dim, num_heads = 2, 32, 6
    q, keys, values, table, seq_lens, qsl = three_requests(2, num_kv_heads, head_dim, num_heads)
    query_lens = [23, 1, 64]
    out = torch.empty_like(q)
    torch.ops.dabba_cpu.paged_attention(out, q, keys.transpose(2, 3).contiguous(), values, table, qsl, seq_lens, 0.3)
    for s in range(3):
        n = int(seq_lens[s])
        k = keys[:, table[s]].reshape(num_kv_heads, -1, head_dim)[:, :n]
        v = values[:, table[s]].reshape(num_kv_heads, -1, head_dim)[:, :n]
        for i in range(query_lens[s]):
            pos = n - query_lens[s] + i  # attends positions 0 .. pos
            for h in range(num_heads):
                kvh = h // (num_heads // num_kv_heads)
                p = torch.softmax((k[kvh, :pos + 1] @ q[qsl[s] + i, h]) * 0.3, dim=0)
                torch.testing.assert_close(out[qsl[s] + i, h], p @ v[kvh, :pos + 1], atol=1e-5, rtol=1e-5)


def test_prompt_kernel_rejects_inconsistent_indices() -> None:
    cache = torch.zeros(2, 1, 4, 16, 16)  # one kv head, 4 blocks of 16, head_dim 16
    q = torch.randn(5, 2, 16)
    with pytest.raises(RuntimeError, match="query_start_loc must end"):
        torch.ops.dabba_cpu.paged_attention(torch.empty_like(q), q, cache[0], cache[1], torch.zeros(1, 4, dtype=torch.long),
                                            torch.tensor([0, 4]), torch.tensor([4]), 1.0)
    with pytest.raises(RuntimeError, match="query longer than its sequence"):
        torch.ops.dabba_cpu.paged_attention(torch.empty_like(q), q, cache[0], cache[1], torch.zeros(1, 4, dtype=torch.long),
                                            torch.tensor([0, 5]), torch.tensor([4]), 1.0)


# Windows below, at and across block boundaries: 1 (a query sees only itself), smaller than a block,
# a block exactly, not a multiple of one, and around the contexts' own lengths (70 + 1 = 71 keys:
# 70 drops the first key, 71 keeps all, the same as no window).
@pytest.mark.parametrize("sliding_window", [1, 5, 8, 16, 23, 40, 70, 71, 300])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [
    (9, 3, 64, 16), (8, 1, 32, 16), (4, 2, 24, 16), (6, 6, 16, 8),  # grouped passes, bf16 pairs, per-head loops
])
@pytest.mark.parametrize("query_lens, context_lens", [([1, 1, 37, 1, 5, 1], [70, 3, 0, 130, 40, 0]),
                                                      ([1, 1, 1, 1], [70, 0, 130, 15]),
                                                      ([150, 1, 33], [0, 17, 260])],
                         ids=["mixed", "decodes", "long"])
def test_cpu_backend_matches_reference_with_a_sliding_window(sliding_window, dtype, atol, num_heads, num_kv_heads,
                                                             head_dim, block_size, query_lens, context_lens) -> None:
    (ref, _, _), (got, _, _) = run_both_backends(dtype, num_heads, num_kv_heads, head_dim, block_size, query_lens,
                                                 context_lens, sliding_window)
    torch.testing.assert_close(got, ref, atol=atol, rtol=0)


def explicit_windowed_attention(q, keys, values, table, qsl, seq_lens, scale, window):
    """Per query row, by hand: position p attends keys max(0, p - window + 1) .. p."""
    num_kv_heads, _, _, head_dim = keys.shape
    num_heads = q.shape[1]
    out = torch.empty_like(q)
    for s in range(len(seq_lens)):
        n, query_len = int(seq_lens[s]), int(qsl[s + 1] - qsl[s])
        k = keys[:, table[s]].reshape(num_kv_heads, -1, head_dim)[:, :n]
        v = values[:, table[s]].reshape(num_kv_heads, -1, head_dim)[:, :n]
        for i in range(query_len):
            pos = n - query_len + i
            lo = max(0, pos - window + 1)
            for h in range(num_heads):
                kvh = h // (num_heads // num_kv_heads)
                p = torch.softmax((k[kvh, lo:pos + 1] @ q[qsl[s] + i, h]) * scale, dim=0)
                out[qsl[s] + i, h] = p @ v[kvh, lo:pos + 1]
    return out


@pytest.mark.parametrize("window", [1, 2, 15, 16, 17, 32, 33, 49, 50, 64])
def test_kernels_against_an_explicit_sliding_window(window) -> None:
    """Both kernels alone, float32: a query at position p sees exactly the `window` keys ending at p
    (transformers: kv_idx > q_idx - sliding_window), so window 50 at seq_len 50 sees every key and
    window 49 drops key 0."""
    num_kv_heads, head_dim, num_heads = 2, 32, 6
    q, keys, values, table, seq_lens, qsl = three_requests(3, num_kv_heads, head_dim, num_heads)
    out = torch.empty_like(q)
    torch.ops.dabba_cpu.paged_attention(out, q, keys.transpose(2, 3).contiguous(), values, table, qsl, seq_lens, 0.3,
                                        window)
    expected = explicit_windowed_attention(q, keys, values, table, qsl, seq_lens, 0.3, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

    decode_q = torch.randn(3, num_heads, head_dim)
    decode_out = torch.empty_like(decode_q)
    torch.ops.dabba_cpu.paged_decode_attention(decode_out, decode_q, keys.transpose(2, 3).contiguous(), values, table,
                                               seq_lens, 0.3, window)
    expected = explicit_windowed_attention(decode_q, keys, values, table, torch.arange(4), seq_lens, 0.3, window)
    torch.testing.assert_close(decode_out, expected, atol=1e-5, rtol=1e-5)
    if window >= 64:  # covers every context: the same as no window
        torch.ops.dabba_cpu.paged_attention(expected := torch.empty_like(q), q, keys.transpose(2, 3).contiguous(),
                                            values, table, qsl, seq_lens, 0.3)
        assert torch.equal(out, expected)


def test_reference_window_mask_is_transformers_sliding_window_mask() -> None:
    """The reference's prompt mask equals transformers' own sliding-window causal mask function."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    fn = sliding_window_causal_mask_function(5)
    expected = fn(torch.tensor(0), torch.tensor(0), torch.arange(12, 20)[:, None], torch.arange(20)[None, :])
    assert expected.shape == (8, 20) and expected.sum(1).tolist() == [5] * 8
    assert torch.equal(window_mask(12, 20, 5, "cpu"), expected)


@pytest.mark.parametrize("sliding_window", [None, 1, 7, 16, 33])
def test_dense_calibration_backend_slides_like_the_reference(sliding_window) -> None:
    """DenseCausalBackend (calibration and evaluation passes, no cache) applies a layer's window as
    the reference backend does on a whole 33-token prompt (window 33: all of it)."""
    from dabba.attention.dense import DenseCausalBackend

    torch.manual_seed(4)
    seq_len, num_heads, num_kv_heads, head_dim, block_size = 33, 4, 2, 16, 16
    q, k, v = (torch.randn(seq_len, h, head_dim) for h in (num_heads, num_kv_heads, num_kv_heads))
    ref = TorchRefBackend()
    common = make_step([seq_len], [0], block_size, 4)
    cache = torch.zeros(ref.kv_cache_shape(4, block_size, num_kv_heads, head_dim))
    expected = ref.forward(q, k, v, cache, ref.build_metadata(common), 0.25, sliding_window)
    got = DenseCausalBackend(seq_len).forward(q, k, v, None, None, 0.25, sliding_window)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    if sliding_window == 1:  # each token sees only itself
        torch.testing.assert_close(got, v.repeat_interleave(num_heads // num_kv_heads, dim=1))


# Gemma's shapes: head_dim 256 (16 lanes x 16 chunks: the grouped passes, past the 8-chunk per-head
# loop), GQA 4:1 and 1:1, with and without Gemma 2's attention soft cap and a window; then the soft
# cap on the per-head loops (head_dim 24, blocks of 8).
@pytest.mark.parametrize("softcap", [None, 5.0, 50.0])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size, sliding_window", [
    (8, 2, 256, 16, None), (4, 4, 256, 16, 40), (3, 1, 256, 16, 23), (4, 2, 24, 8, None), (4, 2, 24, 16, 40),
])
@pytest.mark.parametrize("query_lens, context_lens", [([1, 1, 37, 1, 5, 1], [70, 3, 0, 130, 40, 0]),
                                                      ([1, 1, 1], [70, 0, 130])], ids=["mixed", "decodes"])
def test_cpu_backend_matches_reference_with_gemma_shapes_and_softcap(softcap, dtype, atol, num_heads, num_kv_heads,
                                                                     head_dim, block_size, sliding_window, query_lens,
                                                                     context_lens) -> None:
    # a scale of 0.5 makes raw scores of ~10 at head_dim 256, so a cap of 5 saturates many of them
    scale = 0.5 if softcap == 5.0 else None
    (ref, _, _), (got, _, _) = run_both_backends(dtype, num_heads, num_kv_heads, head_dim, block_size, query_lens,
                                                 context_lens, sliding_window, softcap, scale)
    torch.testing.assert_close(got, ref, atol=atol, rtol=0)
    if softcap == 5.0:  # the cap changes the result: the comparison above is not vacuous
        (uncapped, _, _), _ = run_both_backends(dtype, num_heads, num_kv_heads, head_dim, block_size, query_lens,
                                                context_lens, sliding_window, None, scale)
        assert (uncapped - ref).abs().max() > 0.1


def test_kernels_against_explicit_softcapped_attention() -> None:
    """Both kernels alone, float32, head_dim 256: scores = 5 tanh((q . k * scale) / 5), then the
    causal (and windowed) softmax, written out per query row."""
    num_kv_heads, head_dim, num_heads = 2, 256, 4
    scale, cap = 0.4, 5.0
    q, keys, values, table, seq_lens, qsl = three_requests(4, num_kv_heads, head_dim, num_heads)
    for window in (0, 21):
        out = torch.empty_like(q)
        torch.ops.dabba_cpu.paged_attention(out, q, keys.transpose(2, 3).contiguous(), values, table, qsl, seq_lens,
                                            scale, window, cap)
        decode_out = torch.empty_like(q[:3])
        torch.ops.dabba_cpu.paged_decode_attention(decode_out, q[:3].contiguous(), keys.transpose(2, 3).contiguous(),
                                                   values, table, seq_lens, scale, window, cap)
        for s in range(3):
            n = int(seq_lens[s])
            k = keys[:, table[s]].reshape(num_kv_heads, -1, head_dim)[:, :n]
            v = values[:, table[s]].reshape(num_kv_heads, -1, head_dim)[:, :n]
            rows = [(out, int(qsl[s]) + i, n - int(qsl[s + 1] - qsl[s]) + i) for i in range(int(qsl[s + 1] - qsl[s]))]
            rows.append((decode_out, s, n - 1))
            for result, row, pos in rows:
                lo = max(0, pos - window + 1) if window else 0
                for h in range(num_heads):
                    kvh = h // (num_heads // num_kv_heads)
                    scores = cap * torch.tanh((k[kvh, lo:pos + 1] @ q[row, h]) * scale / cap)
                    expected = torch.softmax(scores, dim=0) @ v[kvh, lo:pos + 1]
                    torch.testing.assert_close(result[row, h], expected, atol=1e-5, rtol=1e-5)
