"""Native CPU element-wise kernels against the plain-PyTorch formulas they replace (which follow
transformers' op order): exact in float32 up to float rounding, and in bf16 equal to the
reference rounding except where SiLU's exp differs in the last bit before rounding."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dabba.layers.rotary import _rotate_half
from dabba.ops.native import load_cpu_ops

pytestmark = pytest.mark.skipif(not load_cpu_ops(), reason="native CPU kernels cannot be built here")
ops = torch.ops.dabba_cpu if load_cpu_ops() else None


def ref_rms_norm(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_fused_add(dtype) -> None:
    torch.manual_seed(0)
    x, res = torch.randn(37, 96, dtype=dtype) * 3, torch.randn(37, 96, dtype=dtype)
    w = torch.randn(96, dtype=dtype)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    torch.testing.assert_close(out, ref_rms_norm(x, w, 1e-6), atol=1e-5 if dtype == torch.float32 else 0.02, rtol=1e-5)
    if dtype == torch.bfloat16:  # one rounding step apart at most
        assert (out.float() - ref_rms_norm(x, w, 1e-6).float()).abs().max() <= 2 ** -6 * w.abs().max()
    x2, res2 = x.clone(), res.clone()
    ops.fused_add_rms_norm(x2, res2, w, 1e-6)
    assert torch.equal(res2, x + res)  # the add rounds to the dtype exactly as the reference's
    torch.testing.assert_close(x2, ref_rms_norm(x + res, w, 1e-6), atol=1e-5 if dtype == torch.float32 else 0.02, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(19, 2 * 80, dtype=dtype) * 4
    x[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-8, -1e-8], dtype=dtype)  # edges of exp's range
    out = torch.empty(19, 80, dtype=dtype)
    ops.silu_and_mul(out, x)
    gate, up = x.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        mismatched = (out != ref).float().mean().item()
        assert mismatched < 0.01, f"{mismatched:.3%} of bf16 results differ from the reference rounding"
        torch.testing.assert_close(out, ref, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul(dtype) -> None:
    """GeGLU (Gemma's gelu_pytorch_tanh): the kernel's x * sigmoid(2y) form against PyTorch's
    gelu(approximate="tanh"), and act_and_mul's dispatch to both."""
    from dabba.ops import native
    from dabba.ops.activation import act_and_mul

    torch.manual_seed(0)
    x = torch.randn(19, 2 * 80, dtype=dtype) * 4
    x[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-8, -1e-8, 1e4, -1e4], dtype=dtype)  # exp's and x^3's edges
    out = torch.empty(19, 80, dtype=dtype)
    ops.gelu_tanh_and_mul(out, x)
    gate, up = x.chunk(2, dim=-1)
    ref = F.gelu(gate, approximate="tanh") * up
    assert not torch.equal(ref, F.gelu(gate) * up)  # the tanh form, not erf's
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:  # the same rounding, except in the tail where tanh(y) ~ -1 and both are mostly cancellation
        differ = out != ref
        assert not (differ & (ref.abs() > 1e-3 * up.abs())).any(), "bf16 results off the reference rounding"
        assert differ.float().mean().item() < 0.05
        torch.testing.assert_close(out, ref, atol=1e-3, rtol=0)
    assert torch.equal(act_and_mul(x, "gelu_tanh"), out)  # the layer path takes the kernel on CPU
    assert native.native_rows(x)
    with pytest.raises(ValueError, match="unknown MLP activation 'relu'"):
        act_and_mul(x, "relu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_strided_views(dtype) -> None:
    torch.manual_seed(0)
    T, H, KVH, D = 11, 4, 2, 24
    qkv = torch.randn(T, (H + 2 * KVH) * D, dtype=dtype)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    q, k = q.view(T, H, D), k.view(T, KVH, D)
    cos, sin = torch.randn(T, D, dtype=dtype), torch.randn(T, D, dtype=dtype)
    ref_q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
    ref_k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
    v_before = v.clone()
    ops.rotary_embedding(q, k, cos, sin)
    if dtype == torch.bfloat16:  # rounds after each product and after the sum, as the reference
        assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    else:  # the compiler may fuse multiply-add: one float32 rounding apart
        torch.testing.assert_close(q, ref_q, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(k, ref_k, atol=1e-6, rtol=1e-6)
    assert torch.equal(v, v_before), "rotating q/k must not touch v"



def test_rotary_float32_angles_on_bf16() -> None:
    """Vision towers' form (apply_rotary_float32): bf16 q and k rotated in float32, rounded once.
    Equal to the reference but where a fused multiply-add moves the float32 sum across a bf16
    rounding boundary: one bf16 step, in a few elements."""
    from dabba.layers.rotary import apply_rotary_float32

    torch.manual_seed(0)
    T, H, D = 33, 4, 80
    qkv = torch.randn(T, 3, H, D, dtype=torch.bfloat16) * 4
    q, k, v = qkv.unbind(1)
    angles = torch.randn(T, D) * 3
    cos, sin = angles.cos(), angles.sin()
    want = [(t.float() * cos[:, None] + _rotate_half(t.float()) * sin[:, None]).to(torch.bfloat16) for t in (q, k)]
    v_before = v.clone()
    got = apply_rotary_float32(q, k, cos, sin)
    assert got[0].data_ptr() == q.data_ptr()  # in place, through the views
    for g, w in zip(got, want):
        diff = (g.float() - w.float()).abs()
        assert (diff > 0).float().mean() < 0.01 and (diff <= w.float().abs() * 2 ** -7 + 1e-30).all()
    assert torch.equal(v, v_before)
