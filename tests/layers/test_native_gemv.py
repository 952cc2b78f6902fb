"""The native bf16 GEMV kernel (decode's linear layers) against float32 arithmetic on the same
bf16 operands: it may differ from F.linear only in the order of float32 additions, so each
output is the float32 result rounded to bf16, give or take an ulp of the sum."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dabba import native

pytestmark = pytest.mark.skipif(not native.gemv_available(), reason="no AVX512-BF16 kernel here")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 12])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (37, 70), (13, 1536), (8, 31)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_float32_products(rows, out_features, in_features, bias) -> None:
    torch.manual_seed(rows + out_features)
    x = torch.randn(rows, in_features).bfloat16()
    w = (torch.randn(out_features, in_features) * 0.1).bfloat16()
    b = torch.randn(out_features).bfloat16() if bias else None
    got = native.linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    exact = x.double() @ w.double().T  # bf16 products are exact; only the additions round
    if b is not None:
        exact = exact + b.double()  # added before the one rounding, as F.linear's addmm does
    # within an ulp of bf16 plus float32 summation error, relative to the sum of |terms|
    bound = (x.double().abs() @ w.double().abs().T) * 2**-20 + exact.abs() * 2**-7
    assert ((got.double() - exact).abs() <= bound + 1e-30).all()
    assert ((got.double() - F.linear(x, w, b).double()).abs() <= 2 * bound + 1e-30).all()


def test_strided_rows_and_other_cases_fall_back() -> None:
    x = torch.randn(3, 128).bfloat16()
    w = torch.randn(64, 128).bfloat16()
    padded = torch.randn(3, 256).bfloat16()[:, :128]  # a row stride wider than the row: still the kernel
    torch.testing.assert_close(native.linear(padded, w), F.linear(padded, w), atol=0, rtol=2**-7)
    many = torch.randn(native.GEMV_MAX_ROWS + 1, 128).bfloat16()  # a prefill: F.linear
    assert torch.equal(native.linear(many, w), F.linear(many, w))
    assert torch.equal(native.linear(x.float(), w.float()), F.linear(x.float(), w.float()))
    assert torch.equal(native.linear(x, w.T.contiguous().T), F.linear(x, w.T.contiguous().T))  # strided weight


def test_kernel_rejects_bad_shapes() -> None:
    out = torch.empty(1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.dabba_cpu.bf16_gemv(out, torch.randn(1, 128).bfloat16(), torch.randn(64, 100).bfloat16(), None)
    with pytest.raises(RuntimeError, match=f"1 to {native.GEMV_MAX_ROWS} rows"):
        torch.ops.dabba_cpu.bf16_gemv(torch.empty(native.GEMV_MAX_ROWS + 1, 64, dtype=torch.bfloat16),
                                      torch.randn(native.GEMV_MAX_ROWS + 1, 128).bfloat16(),
                                      torch.randn(64, 128).bfloat16(), None)

