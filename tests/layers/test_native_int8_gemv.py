"""The native INT8 GEMV (decode's INT8 linear layers) against exact products of the same codes:
it quantizes each activation row to int16 with one scale, so every output may be off by that
rounding (at most max|x| / 65534 per element, times the codes' magnitudes), float32 summation
and the output's own rounding, and no more."""
from __future__ import annotations

import pytest
import torch

from dabba import native

pytestmark = pytest.mark.skipif(not native.int8_gemv_available(), reason="no AVX-512 VNNI kernel here")


def _bound(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    xd, qd, sd = x.double(), q.double(), s.double()
    amax = xd.abs().amax(1, keepdim=True)
    quant = (amax / 65534) * qd.abs().sum(1) * sd.abs()  # int16 rounding of x, through every code
    sums = (xd.abs() @ qd.abs().T) * sd.abs() * 2**-20  # float32 additions
    out = xd @ qd.T * sd + (b.double() if b is not None else 0)
    ulp = 2**-7 if x.dtype == torch.bfloat16 else 2**-22  # the product's rounding, then the bias add's
    return quant + sums + (out.abs() + (b.double().abs() if b is not None else 0)) * ulp + 1e-30


@pytest.mark.parametrize("rows", [1, 2, 3, 6])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (37, 70), (13, 1536), (9, 31), (5, 5000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_gemv_matches_exact_products(rows, out_features, in_features, dtype, bias) -> None:
    torch.manual_seed(rows * 7 + out_features)
    x = torch.randn(rows, in_features).to(dtype)
    x[0, 3] = 40.0  # an outlier channel sets the int16 scale of its row
    q = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8)
    s = (torch.rand(out_features) * 0.01 + 1e-3).to(dtype)
    b = torch.randn(out_features).to(dtype) if bias else None
    got = native.int8_linear(x, q, s, b)
    assert got is not None and got.dtype == dtype and got.shape == (rows, out_features)
    exact = x.double() @ q.double().T * s.double() + (b.double() if b is not None else 0)
    bound = _bound(x, q, s, b)
    assert ((got.double() - exact).abs() <= bound).all()
    if in_features % 64 == 0:  # (PyTorch's kernel crashes on some odd shapes, such as 37 x 70)
        ref = torch.ops.aten._weight_int8pack_mm(x, q, s)  # what longer batches get
        ref = ref + b if b is not None else ref
        assert ((got.double() - ref.double()).abs() <= 2 * bound).all()


def test_zero_rows_and_fallbacks() -> None:
    q = torch.randint(-128, 128, (64, 128), dtype=torch.int8)
    s = torch.rand(64).bfloat16()
    zero = torch.zeros(2, 128).bfloat16()
    assert torch.equal(native.int8_linear(zero, q, s), torch.zeros(2, 64).bfloat16())
    padded = torch.randn(3, 256).bfloat16()[:, :128]  # a row stride wider than the row: still the kernel
    assert native.int8_linear(padded, q, s) is not None
    assert native.int8_linear(torch.randn(native.INT8_GEMV_MAX_ROWS + 1, 128).bfloat16(), q, s) is None  # a prefill
    assert native.int8_linear(torch.randn(2, 128).half(), q, s.half()) is None
    assert native.int8_linear(torch.randn(2, 128), q, s) is None  # scales in another dtype
    assert native.int8_linear(torch.randn(2, 128).bfloat16(), q.T.contiguous().T, s) is None  # strided codes


def test_kernel_rejects_bad_shapes() -> None:
    out = torch.empty(1, 64, dtype=torch.bfloat16)
    s = torch.rand(64).bfloat16()
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.dabba_cpu.int8_gemv(out, torch.randn(1, 128).bfloat16(), torch.zeros(64, 100, dtype=torch.int8),
                                      s, None)
    with pytest.raises(RuntimeError, match="scales must be"):
        torch.ops.dabba_cpu.int8_gemv(out, torch.randn(1, 128).bfloat16(), torch.zeros(64, 128, dtype=torch.int8),
                                      s.float(), None)
    with pytest.raises(RuntimeError, match=f"1 to {native.INT8_GEMV_MAX_ROWS} rows"):
        torch.ops.dabba_cpu.int8_gemv(torch.empty(native.INT8_GEMV_MAX_ROWS + 1, 64, dtype=torch.bfloat16),
                                      torch.randn(native.INT8_GEMV_MAX_ROWS + 1, 128).bfloat16(),
                                      torch.zeros(64, 128, dtype=torch.int8), s, None)
