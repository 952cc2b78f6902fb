"""dabba's bf16 linear kernels on the CPU (the GEMV for decode's few rows, the GEMM beyond, on AMX
tiles where the CPU has them; the avx2 build's own GEMM from avx2_gemm_min_rows rows) against
float32 arithmetic on the same bf16 operands: they may differ from F.linear only in the order of
float32 additions, so each output is the float32 result rounded to bf16, give or take an ulp of the
sum."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dabba.ops import native

pytestmark = pytest.mark.skipif(not native.gemv_available(), reason="no AVX512-BF16 or AVX2 GEMV here")
needs_gemm = pytest.mark.skipif(not native.gemm_available(), reason="no AVX512-BF16 GEMM here")
limits = native.kernel_constants()  # the row thresholds the kernels choose by (csrc/cpu_ops.h)


def assert_rounded_products(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    assert got.dtype == torch.bfloat16 and got.shape == (x.shape[0], w.shape[0])
    exact = x.double() @ w.double().T  # bf16 products are exact; only the additions round
    if b is not None:
        exact = exact + b.double()  # added before the one rounding, as F.linear's addmm does
    # within an ulp of bf16 plus float32 summation error, relative to the sum of |terms|
    bound = (x.double().abs() @ w.double().abs().T) * 2**-20 + exact.abs() * 2**-7
    assert ((got.double() - exact).abs() <= bound + 1e-30).all()
    assert ((got.double() - F.linear(x, w, b).double()).abs() <= 2 * bound + 1e-30).all()


# rows: the GEMV (<= 8), the GEMM's 16-row vectors in chunks of 2, a last chunk of 3 or of 1,
# and partial vectors; out_features: whole and partial tiles of 8 and 16 weight rows
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 9, 16, 17, 33, 40, 64, 100])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (37, 70), (13, 1536), (200, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float32_products(rows, out_features, in_features, bias) -> None:
    torch.manual_seed(rows + out_features)
    x = torch.randn(rows, in_features).bfloat16()
    w = (torch.randn(out_features, in_features) * 0.1).bfloat16()
    b = torch.randn(out_features).bfloat16() if bias else None
    assert_rounded_products(native.linear(x, w, b), x, w, b)


amx = native.amx_usable(256)  # the GEMM's AMX tiles are here (else amx=True takes the AVX512 ones too)


@needs_gemm
@pytest.mark.parametrize("rows", [1, 5, 31, 48])
@pytest.mark.parametrize("use_amx", [False, True])
def test_gemm_kernel_at_any_row_count(rows, use_amx) -> None:
    """The GEMM itself, below the GEMV's limit too, into a wider output (a row stride); both its
    tiles (AVX512-BF16, the reference, and AMX)."""
    torch.manual_seed(rows)
    x = torch.randn(rows, 256).bfloat16()
    w = torch.randn(45, 256).bfloat16()
    b = torch.randn(45).bfloat16()
    out = torch.full((rows, 60), 7.0, dtype=torch.bfloat16)
    torch.ops.dabba_cpu.bf16_gemm(out[:, :45], x, w, b, use_amx)
    assert_rounded_products(out[:, :45], x, w, b)
    assert (out[:, 45:] == 7.0).all()  # nothing written past the output's columns


@needs_gemm
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 40])
@pytest.mark.parametrize("in_features", [1024, 2048])
def test_tiles_for_rows_whose_lines_collide_give_the_same_sums(rows, in_features) -> None:
    """Where K is a multiple of 1024 the AVX512 tiles take fewer weight rows at once (their lines
    would crowd one L1 set): the same pairs in the same order, so the same bits as the usual tiles
    give with K padded by zero pairs (which add +0 to every sum), plain, gated and on INT8 codes."""
    torch.manual_seed(rows + in_features)
    ops = torch.ops.dabba_cpu
    x = torch.randn(rows, in_features).bfloat16()
    w = (torch.randn(40, in_features) * 0.1).bfloat16()
    b = torch.randn(40).bfloat16()
    pad = lambda t: F.pad(t, (0, 32))  # noqa: E731
    for op, cols in ((ops.bf16_gemm, 40), (ops.bf16_gemm_silu_and_mul, 20), (ops.bf16_gemm_gelu_tanh_and_mul, 20)):
        got, ref = (torch.empty(rows, cols, dtype=torch.bfloat16) for _ in range(2))
        op(got, x, w, b, False)
        op(ref, pad(x), pad(w), b, False)
        assert torch.equal(got, ref), op
    assert_rounded_products(_gemm(x, w, b), x, w, b)  # and right
    codes = torch.randint(-127, 128, (40, in_features), dtype=torch.int8)
    scales = (torch.rand(40) * 0.01).bfloat16()
    got, ref = (torch.empty(rows, 40, dtype=torch.bfloat16) for _ in range(2))
    ops.int8_gemm(got, x, codes, scales, b, False)
    ops.int8_gemm(ref, pad(x), pad(codes), scales, b, False)
    assert torch.equal(got, ref)


def _gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    torch.ops.dabba_cpu.bf16_gemm(out, x, w, b, False)
    return out


@pytest.mark.skipif(not amx, reason="no AMX tiles here")
@pytest.mark.parametrize("out_features", [13, 32, 45, 100, 2 * 17 * 32])
@pytest.mark.parametrize("in_features", [96, 2112])
def test_amx_tiles_match_the_reference_tiles_and_ignore_the_batch(out_features, in_features) -> None:
    """AMX steps take 32 weight rows (a partial last step is padded) against 16 or 32 rows of x and
    split the output across threads in 32s; past 2048 inputs K goes in ranges of 1024 whose sums
    carry through memory. Every shape of that agrees with the AVX512 tiles to rounding. Each output
    depends only on its own row of x, so a row's result is the same alone as in any batch."""
    torch.manual_seed(out_features)
    x = torch.randn(100, in_features).bfloat16()
    w = (torch.randn(out_features, in_features) * 0.1).bfloat16()
    b = torch.randn(out_features).bfloat16()
    got, ref = (torch.empty(100, out_features, dtype=torch.bfloat16) for _ in range(2))
    torch.ops.dabba_cpu.bf16_gemm(got, x, w, b, True)
    torch.ops.dabba_cpu.bf16_gemm(ref, x, w, b, False)
    assert_rounded_products(got, x, w, b)
    assert ((got.double() - ref.double()).abs() <= 2 * (ref.double().abs() * 2**-7 + 1e-3)).all()
    for rows in (1, 3, 16, 17, 33):
        assert torch.equal(native.linear(x[5:5 + rows], w, b), got[5:5 + rows])


def test_odd_in_features_and_other_cases_fall_back() -> None:
    w = torch.randn(64, 128).bfloat16()
    for rows in (3, 20):  # a row stride wider than the row: still the kernels
        padded = torch.randn(rows, 256).bfloat16()[:, :128]
        assert_rounded_products(native.linear(padded, w), padded, w, None)
    x = torch.randn(20, 128).bfloat16()
    assert torch.equal(native.linear(x.float(), w.float()), F.linear(x.float(), w.float()))
    assert torch.equal(native.linear(x, w.T.contiguous().T), F.linear(x, w.T.contiguous().T))  # strided weight
    odd_x, odd_w = torch.randn(20, 31).bfloat16(), torch.randn(8, 31).bfloat16()  # the GEMM pairs K
    assert_rounded_products(native.linear(odd_x[:4], odd_w), odd_x[:4], odd_w, None)  # the GEMV masks K's tail
    assert native.linear(x[:0], w).shape == (0, 64)
    long = torch.randn(limits.gemm_max_rows + 1, 128).bfloat16()  # a long prefill: oneDNN's blocking wins
    if native.gemm_available():
        assert torch.equal(native.linear(odd_x, odd_w), F.linear(odd_x, odd_w))
        assert torch.equal(native.linear(long, w), F.linear(long, w))
    else:  # the avx2 build: the GEMV in passes, or its GEMM
        assert_rounded_products(native.linear(odd_x, odd_w), odd_x, odd_w, None)
        assert_rounded_products(native.linear(long, w), long, w, None)


def test_gemv_rejects_bad_shapes() -> None:
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.dabba_cpu.bf16_gemv(torch.empty(1, 64, dtype=torch.bfloat16), torch.randn(1, 128).bfloat16(),
                                      torch.randn(64, 100).bfloat16(), None)
    with pytest.raises(RuntimeError, match=f"1 to {limits.gemv_max_rows} rows"):
        torch.ops.dabba_cpu.bf16_gemv(torch.empty(limits.gemv_max_rows + 1, 64, dtype=torch.bfloat16),
                                      torch.randn(limits.gemv_max_rows + 1, 128).bfloat16(),
                                      torch.randn(64, 128).bfloat16(), None)


@needs_gemm
def test_gemm_rejects_bad_shapes() -> None:
    out = torch.empty(1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.dabba_cpu.bf16_gemm(out, torch.randn(1, 128).bfloat16(), torch.randn(64, 100).bfloat16(), None)
    with pytest.raises(RuntimeError, match="even K"):
        torch.ops.dabba_cpu.bf16_gemm(out, torch.randn(1, 31).bfloat16(), torch.randn(64, 31).bfloat16(), None)


@pytest.mark.parametrize("rows", [1, 8, 9, 20, 33, 64, 100, 257])
@pytest.mark.parametrize("d, in_features", [(1536, 576), (37, 70), (8, 64)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_mlp_fused_into_the_gemm_is_bit_identical(rows, d, in_features, bias, activation) -> None:
    """Past the GEMV's rows the GEMM stores act(gate) * up itself (SwiGLU, GeGLU): exactly what the
    projection followed by the elementwise kernel gives where the projection takes the GEMM too (on
    AMX tiles the fused GEMM takes any row count, and the plain projection F.linear past
    gemm_max_rows)."""
    from dabba.ops.activation import act_and_mul

    torch.manual_seed(rows + d)
    x = torch.randn(rows, in_features).bfloat16()
    w = (torch.randn(2 * d, in_features) * 0.2).bfloat16()
    b = torch.randn(2 * d).bfloat16() if bias else None
    fused = native.linear_act_and_mul(x, w, b, activation)
    assert fused.shape == (rows, d)
    if rows <= limits.gemm_max_rows or not native.amx_usable(in_features):
        assert torch.equal(fused, act_and_mul(native.linear(x, w, b), activation))
    gate, up = F.linear(x, w, b).chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    torch.testing.assert_close(fused, act * up, atol=0.05, rtol=0.02)


@needs_gemm
@pytest.mark.parametrize("op", ["bf16_gemm_silu_and_mul", "bf16_gemm_gelu_tanh_and_mul"])
@pytest.mark.parametrize("rows, d", [(5, 40), (33, 16), (70, 100)])
def test_gated_gemm_tiles_agree(op, rows, d) -> None:
    """The gated GEMM on AMX tiles (where here) and on the AVX512 tiles, the reference."""
    torch.manual_seed(rows)
    x = torch.randn(rows, 128).bfloat16()
    w = (torch.randn(2 * d, 128) * 0.2).bfloat16()
    b = torch.randn(2 * d).bfloat16()
    got, ref = (torch.empty(rows, d, dtype=torch.bfloat16) for _ in range(2))
    getattr(torch.ops.dabba_cpu, op)(got, x, w, b, True)
    getattr(torch.ops.dabba_cpu, op)(ref, x, w, b, False)
    torch.testing.assert_close(got, ref, atol=0.05, rtol=0.02)


@needs_gemm
def test_swiglu_kernel_rejects_bad_shapes() -> None:
    x = torch.randn(16, 64).bfloat16()
    with pytest.raises(RuntimeError, match="gate rows, then up rows"):
        torch.ops.dabba_cpu.bf16_gemm_silu_and_mul(torch.empty(16, 3, dtype=torch.bfloat16), x,
                                                   torch.randn(7, 64).bfloat16(), None)
    with pytest.raises(RuntimeError, match=r"out must be \[M, 4\]"):
        torch.ops.dabba_cpu.bf16_gemm_silu_and_mul(torch.empty(16, 8, dtype=torch.bfloat16), x,
                                                   torch.randn(8, 64).bfloat16(), None)


@pytest.mark.skipif(not native.avx2_gemm_available(), reason="the avx2 variant's GEMM is not built here")
@pytest.mark.parametrize("rows", [1, 4, 5, 6, 11, 64])
@pytest.mark.parametrize("out_features, in_features", [(45, 256), (16, 7), (3, 2000), (33, 1031)])
def test_avx2_gemm_at_any_shape_and_independent_of_the_batch(rows, out_features, in_features) -> None:
    """The avx2 variant's GEMM itself: 5-row tiles (a partial last one), 16-column panels (a partial
    last one), K not a multiple of the 8-wide transposes, chunks of x rows (2000 inputs: 130 rows a
    chunk, so 300 rows take three), into a wider output (a row stride). Each row's output is the
    same alone as in any batch."""
    torch.manual_seed(rows + in_features)
    x = torch.randn(300, in_features).bfloat16()
    w = (torch.randn(out_features, in_features) * 0.1).bfloat16()
    b = torch.randn(out_features).bfloat16()
    full = torch.empty(300, out_features, dtype=torch.bfloat16)
    torch.ops.dabba_cpu.avx2_bf16_gemm(full, x, w, b)
    assert_rounded_products(full, x, w, b)
    out = torch.full((rows, out_features + 5), 7.0, dtype=torch.bfloat16)
    torch.ops.dabba_cpu.avx2_bf16_gemm(out[:, :out_features], x[7:7 + rows], w, None)
    assert_rounded_products(out[:, :out_features], x[7:7 + rows], w, None)
    assert (out[:, out_features:] == 7.0).all()  # nothing written past the output's columns
    alone = torch.empty(rows, out_features, dtype=torch.bfloat16)
    torch.ops.dabba_cpu.avx2_bf16_gemm(alone, x[7:7 + rows], w, b)
    assert torch.equal(alone, full[7:7 + rows])
