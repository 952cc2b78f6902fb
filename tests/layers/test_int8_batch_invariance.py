"""How much an INT8 layer's output for one row depends on how many rows share the call (how many
requests share the step). Within each kernel's range of row counts a row's output is the same
bit for bit (each output depends on its own row of x and of codes only); where the row count
crosses a threshold into another kernel, outputs may move by that kernel's roundings: the GEMV's
int16 activations (at most max|x| / 65534 an element), the integer GEMM's 8-bit ones (per 32
values), _weight_int8pack_mm's and the GEMM's float32 sums, and past kGemmMaxRows the dequantized
bf16 weight (2^-9 of each product). The bound is the sum of the two kernels' bounds against exact
products (csrc/cpu_ops.h, int8_linear)."""
from __future__ import annotations

import pytest
import torch

from dabba.ops import native
from dabba.quantization.gguf import rounded_activations

pytestmark = pytest.mark.skipif(not native.load_cpu_ops(), reason="native CPU kernels cannot be built here")


def _kernel(rows: int, in_features: int) -> str:
    """Which kernel int8_linear takes for bf16 rows (its choice in csrc/gemm_cpu.cpp, restated)."""
    c = native.kernel_constants()
    amx = native.amx_usable(in_features)
    if native.int8_gemv_available() and (rows <= c.int8_gemv_max_rows or not native.gemm_available()):
        return "gemv"  # (without the GEMM, the avx2 build, the GEMV takes every count of bf16 rows)
    if in_features % 32 == 0 and native.integer_gemm_usable(in_features):
        return "integer"
    gemm_from = c.amx_int8_gemm_min_rows if amx else c.int8_gemm_min_rows
    if native.gemm_available() and (rows >= gemm_from or in_features % 32) and rows <= c.gemm_max_rows:
        return "gemm"
    if rows >= c.int8_dequant_min_rows or in_features % 32:
        return "dequantized"
    return "int8pack_mm"


def _bound(kernel: str, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """|output - exact product| for one kernel: its own roundings, then the output's bf16 rounding."""
    xd, qd, sd = x.double(), q.double(), s.double()
    exact = xd @ qd.T * sd
    magnitudes = (xd.abs() @ qd.abs().T) * sd.abs()
    bound = magnitudes * 2**-20 + exact.abs() * 2**-8 + 1e-30  # float32 sums; the output's rounding
    if kernel == "gemv":
        bound = bound + xd.abs().amax(1, keepdim=True) / 65534 * qd.abs().sum(1) * sd.abs()
    if kernel == "integer":  # x as its 8-bit codes give it back, through every code
        bound = bound + (rounded_activations(x, "Q8_0", torch.float64) - xd).abs() @ qd.abs().T * sd.abs()
    if kernel == "dequantized":
        bound = bound + magnitudes * 2**-8
    return bound


@pytest.mark.parametrize("out_features, in_features", [(960, 576), (200, 1536), (96, 70)])
def test_a_rows_output_moves_only_where_the_kernel_changes_and_within_both_bounds(out_features, in_features):
    torch.manual_seed(out_features)
    rows = [1, 2, 5, 6, 7, 8, 12, 13, 31, 64, 95, 96, 256, 257, 300]
    x = torch.randn(max(rows), in_features).to(torch.bfloat16)
    x[:, 5] *= 30  # an outlier channel, as real activations have
    q = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    s = (torch.rand(out_features) * 0.01 + 1e-3).to(torch.bfloat16)
    probe = x[:4]  # the same four requests, in steps of every size
    outputs = {m: native.int8_linear(x[:m], q, s, None)[:4].double() for m in rows if m >= 4}
    alone = torch.cat([native.int8_linear(probe[i:i + 1], q, s, None) for i in range(4)]).double()
    kernels = {m: _kernel(m, in_features) for m in outputs}
    first = {}
    for m, y in outputs.items():
        k = kernels[m]
        if k in first:  # the same kernel: the same bits, whatever else shares the call
            assert torch.equal(y, outputs[first[k]]), (m, first[k], k)
        first.setdefault(k, m)
        worst = _bound(k, probe, q, s) + _bound(_kernel(1, in_features), probe, q, s)
        assert ((y - alone).abs() <= worst).all(), (m, k)
