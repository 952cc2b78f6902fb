"""dabba's INT8 linear kernels against exact products of the same codes. The GEMV (decode's few
rows) quantizes each activation row to int16 with one scale, so every output may be off by that
rounding (at most max|x| / 65534 per element, times the codes' magnitudes), float32 summation and
the output's own rounding, and no more; the GEMM (batches) multiplies the bf16 rows by the codes
widened to bf16, exactly, so only the summation and the roundings remain. Without AMX tiles bf16
batches take the integer GEMM instead (csrc/int8_code_gemm_cpu.cpp): x rounded to 8-bit codes per 32
values as the GGUF GEMV rounds it, whose exact effect on the products is added to the bound."""
from __future__ import annotations

import pytest
import torch

from dabba.ops import native
from dabba.quantization.gguf import rounded_activations

pytestmark = pytest.mark.skipif(not native.int8_gemv_available(), reason="no AVX-512 VNNI or AVX2 GEMV here")
needs_gemm = pytest.mark.skipif(not native.gemm_available(), reason="no AVX512-BF16 GEMM here")
limits = native.kernel_constants()  # the row thresholds the kernels choose by (csrc/cpu_ops.h)


def integer_gemm_takes(x: torch.Tensor) -> bool:
    """Whether int8_linear takes x to the integer GEMM (csrc/gemm_cpu.cpp's choice, restated)."""
    return x.dtype == torch.bfloat16 and x.shape[0] > limits.int8_gemv_max_rows and x.shape[1] % 32 == 0 and \
        native.integer_gemm_usable(x.shape[1])


def codes_of(x: torch.Tensor) -> torch.Tensor:
    """x as its 8-bit codes per 32 values give it back (the integer GEMM's rounding), float64."""
    return rounded_activations(x, "Q8_0", torch.float64)


def _bound(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None, int16_x: bool = True,
           codes8: bool = False) -> torch.Tensor:
    xd, qd, sd = x.double(), q.double(), s.double()
    amax = xd.abs().amax(1, keepdim=True)
    quant = (amax / 65534) * qd.abs().sum(1) * sd.abs() * int16_x  # int16 rounding of x, through every code
    if codes8:  # the integer GEMM's codes of x, through every code
        quant = (codes_of(x) - xd).abs() @ qd.abs().T * sd.abs()
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


# rows: the GEMM's chunks of 2 vectors, a last one of 3 or 1, partial vectors; out_features:
# whole and partial tiles of 16 code rows, and of the 8-row halves
@needs_gemm
@pytest.mark.parametrize("rows", [7, 9, 17, 40, 64, 100, 256])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (37, 70), (13, 1536), (200, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_gemm_matches_exact_products(rows, out_features, in_features, bias) -> None:
    torch.manual_seed(rows * 7 + out_features)
    x = torch.randn(rows, in_features).bfloat16()
    q = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8)
    s = (torch.rand(out_features) * 0.01 + 1e-3).bfloat16()
    b = torch.randn(out_features).bfloat16() if bias else None
    got = native.int8_linear(x, q, s, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    exact = x.double() @ q.double().T * s.double() + (b.double() if b is not None else 0)
    bound = _bound(x, q, s, b, int16_x=False)
    assert ((got.double() - exact).abs() <= _bound(x, q, s, b, int16_x=False, codes8=integer_gemm_takes(x))).all()
    if integer_gemm_takes(x):  # exactly the products of x's codes, but for the float32 sums and roundings
        of_codes = codes_of(x) @ q.double().T * s.double() + (b.double() if b is not None else 0)
        rounding = (of_codes - exact).abs() * 2**-7  # the output's rounding, of a value that far from exact
        assert ((got.double() - of_codes).abs() <= bound + rounding).all()
    direct, reference = torch.empty_like(got), torch.empty_like(got)
    torch.ops.dabba_cpu.int8_gemm(direct, x, q, s, b)  # the kernel itself, whatever the row count
    assert torch.equal(direct, got) or rows < limits.int8_gemm_min_rows or integer_gemm_takes(x)
    assert ((direct.double() - exact).abs() <= bound).all()
    torch.ops.dabba_cpu.int8_gemm(reference, x, q, s, b, False)  # the AVX512-BF16 tiles, where AMX took direct
    assert ((reference.double() - exact).abs() <= bound).all()
    if in_features % 32 == 0:  # (PyTorch's kernel crashes past that, such as 37 x 70)
        ref = torch.ops.aten._weight_int8pack_mm(x, q, s)
        ref = ref + b if b is not None else ref
        assert ((direct.double() - ref.double()).abs() <= 2 * bound).all()


def test_widths_that_crash_pytorchs_kernel_take_ours() -> None:
    """_weight_int8pack_mm segfaults when in_features is not a multiple of 32: rows that would go to
    it take the GEMM (even in_features) or dequantized codes (odd); a build without the GEMM, the
    GEMV."""
    gemv = not native.gemm_available()  # the INT8 GEMV at every row count
    for in_features in (70, 31):
        q = torch.randint(-128, 128, (37, in_features), dtype=torch.int8)
        s = (torch.rand(37) * 0.01).bfloat16()
        for rows in (limits.int8_gemv_max_rows + 1, limits.int8_gemm_min_rows - 1, limits.gemm_max_rows + 1):
            x = torch.randn(rows, in_features).bfloat16()
            exact = x.double() @ q.double().T * s.double()
            bound = _bound(x, q, s, None, int16_x=gemv)
            if not gemv and (rows > limits.gemm_max_rows or in_features % 2):
                # dequantized codes: each q * s rounds first
                bound = bound + x.double().abs() @ (q.double().abs() * s.double()[:, None]).T * 2**-8
            assert ((native.int8_linear(x, q, s).double() - exact).abs() <= bound).all()


def test_zero_rows_and_fallbacks() -> None:
    q = torch.randint(-128, 128, (64, 128), dtype=torch.int8)
    s = torch.rand(64).bfloat16()
    zero = torch.zeros(2, 128).bfloat16()
    assert torch.equal(native.int8_linear(zero, q, s), torch.zeros(2, 64).bfloat16())
    for rows in (3, 20):  # a row stride wider than the row: still the GEMV, the GEMM (integer or bf16)
        padded = torch.randn(rows, 256).bfloat16()[:, :128]
        assert ((native.int8_linear(padded, q, s).double() - padded.double() @ q.double().T * s.double()).abs()
                <= _bound(padded, q, s, None, int16_x=rows <= limits.int8_gemv_max_rows,
                          codes8=integer_gemm_takes(padded))).all()
    x16 = torch.randn(20, 128).half()  # neither kernel: PyTorch's
    assert torch.equal(native.int8_linear(x16, q, s.half()), torch.ops.aten._weight_int8pack_mm(x16, q, s.half()))
    x32 = torch.randn(limits.int8_dequant_min_rows, 128)  # a long float32 prefill: dequantized codes, F.linear
    torch.testing.assert_close(native.int8_linear(x32, q, s.float()), x32 @ (q.float() * s.float()[:, None]).T)


def test_gemv_rejects_bad_shapes() -> None:
    out = torch.empty(1, 64, dtype=torch.bfloat16)
    s = torch.rand(64).bfloat16()
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.dabba_cpu.int8_gemv(out, torch.randn(1, 128).bfloat16(), torch.zeros(64, 100, dtype=torch.int8),
                                      s, None)
    with pytest.raises(RuntimeError, match="scales must be"):
        torch.ops.dabba_cpu.int8_gemv(out, torch.randn(1, 128).bfloat16(), torch.zeros(64, 128, dtype=torch.int8),
                                      s.float(), None)
    with pytest.raises(RuntimeError, match=f"1 to {limits.int8_gemv_max_rows} rows"):
        torch.ops.dabba_cpu.int8_gemv(torch.empty(limits.int8_gemv_max_rows + 1, 64, dtype=torch.bfloat16),
                                      torch.randn(limits.int8_gemv_max_rows + 1, 128).bfloat16(),
                                      torch.zeros(64, 128, dtype=torch.int8), s, None)


@needs_gemm
def test_gemm_rejects_bad_shapes() -> None:
    s = torch.rand(64).bfloat16()
    with pytest.raises(RuntimeError, match="scales must be"):
        torch.ops.dabba_cpu.int8_gemm(torch.empty(9, 64, dtype=torch.bfloat16), torch.randn(9, 128).bfloat16(),
                                      torch.zeros(64, 128, dtype=torch.int8), s.float(), None)
    with pytest.raises(RuntimeError, match="even K"):
        torch.ops.dabba_cpu.int8_gemm(torch.empty(9, 64, dtype=torch.bfloat16), torch.randn(9, 31).bfloat16(),
                                      torch.zeros(64, 31, dtype=torch.int8), s, None)


# float32 with a bias is left out: there the compiler may fuse the scale's product and the bias
# add into one FMA in one row count's code and not another's (a last-bit difference either way)
@pytest.mark.parametrize("dtype, bias", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, False)])
def test_wide_rows_take_weight_rows_in_pairs_with_the_same_sums(dtype, bias) -> None:
    """Past kInt8PairXBytes of int16 activations (6 rows of K = 8192 here) the GEMV multiplies two
    weight rows per load of x; its sums are exact int32 sums, so each row of its output equals the
    one-row GEMV's bit for bit (an odd out_features takes the last weight row alone)."""
    torch.manual_seed(0)
    rows, out_features, in_features = 6, 33, 8192 + 40  # a masked tail of 40 codes too
    x = torch.randn(rows, in_features).to(dtype)
    q = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8)
    s = (torch.rand(out_features) * 0.01 + 1e-3).to(dtype)
    b = torch.randn(out_features).to(dtype) if bias else None
    whole = torch.empty(rows, out_features, dtype=dtype)
    torch.ops.dabba_cpu.int8_gemv(whole, x, q, s, b)
    for r in range(rows):
        one = torch.empty(1, out_features, dtype=dtype)
        torch.ops.dabba_cpu.int8_gemv(one, x[r:r + 1], q, s, b)
        assert torch.equal(whole[r:r + 1], one), r
