"""The native dense attention (csrc/dense_attention_cpu.cpp) against SDPA in float32 on the same
bf16 inputs: within bf16's rounding of the probabilities and the output, no further from it than
PyTorch's own bf16 SDPA is (twice that, plus a bf16 step), over head dims that fill whole and
partial vectors, key counts that end blocks and pairs short, strided views, and scores large
enough that a softmax without its running max would overflow."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dabba.layers.encoder_attention import dense_attention
from dabba.ops import native

pytestmark = pytest.mark.skipif(not native.dense_attention_available(),
                                reason="native kernels with AVX512-BF16 are not here")


def reference(q, k, v, scale):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale).transpose(1, 2)


def check(q, k, v, scale) -> None:
    out = torch.empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=torch.bfloat16)
    torch.ops.dabba_cpu.dense_attention(out, q, k, v, scale)
    want = reference(q, k, v, scale)
    torch_err = (F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2).float() - want).abs().max()
    err = (out.float() - want).abs().max()
    assert err <= 2 * torch_err + 2 ** -8 * want.abs().max(), (err, torch_err)


@pytest.mark.parametrize("d", [3, 64, 72, 80, 130, 256])
@pytest.mark.parametrize("queries,keys", [(1, 1), (5, 17), (64, 255), (70, 257), (131, 600)])
def test_against_float32_sdpa(d, queries, keys) -> None:
    torch.manual_seed(d * 1000 + keys)
    q = torch.randn(2, 3, queries, d, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 3, keys, d, dtype=torch.bfloat16) for _ in range(2))
    check(q, k, v, d ** -0.5)


def test_strided_views_and_peaked_scores() -> None:
    """q, k, v as views of one [3, tokens, heads, d] projection (the vision towers' layout), and
    scores in the hundreds: exp without the running max would overflow float32."""
    torch.manual_seed(0)
    qkv = torch.randn(3, 2, 300, 4, 80, dtype=torch.bfloat16) * 4
    q, k, v = (t.transpose(1, 2) for t in qkv)  # [batch, heads, tokens, d], d contiguous
    assert not q.is_contiguous()
    check(q, k, v, 1.0)


def test_choice_and_reference() -> None:
    """dense_attention takes the native tiles for bf16 on CPU, SDPA for float32, both laid out
    [batch, queries, heads, d] and contiguous."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 40, 72) for _ in range(3))
    out32 = dense_attention(q, k, v, 0.1)
    assert out32.is_contiguous() and out32.shape == (1, 40, 2, 72)
    torch.testing.assert_close(out32, reference(q, k, v, 0.1))
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    native_out = torch.empty(1, 40, 2, 72, dtype=torch.bfloat16)
    torch.ops.dabba_cpu.dense_attention(native_out, qb, kb, vb, 0.1)
    assert torch.equal(dense_attention(qb, kb, vb, 0.1), native_out)


def test_bad_shapes_refused() -> None:
    q = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        torch.ops.dabba_cpu.dense_attention(torch.empty(1, 4, 2, 8, dtype=torch.bfloat16), q,
                                            torch.randn(1, 3, 4, 8, dtype=torch.bfloat16), q, 1.0)
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.dabba_cpu.dense_attention(torch.empty(1, 4, 2, 8), q.float(), q.float(), q.float(), 1.0)
