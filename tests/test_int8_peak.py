"""benchmarks/int8_peak.py: the int8 probes report a rate where the build has the instruction, and
the GEMM measure reports the path and an operation count consistent with its shape."""
from __future__ import annotations

import pytest
import torch

from benchmarks.int8_peak import measure_gemm, measure_int8_peak
from dabba.ops import native


def test_the_probes_report_a_rate_or_none() -> None:
    peak = measure_int8_peak(seconds=0.05)
    if peak["variant"] != "avx512":
        assert peak["vnni_gops"] is None and peak["amx_int8_gops"] is None
        return
    assert peak["vnni_gops"] > 0
    if native.load_cpu_ops() and torch.ops.dabba_cpu.w8a8_path_available("amx"):
        assert peak["amx_int8_gops"] > peak["vnni_gops"]  # 16 x 16 x 64 an instruction against 16 x 4


@pytest.mark.skipif(not native.load_cpu_ops(), reason="native kernels unavailable")
def test_the_gemm_measure_counts_its_operations() -> None:
    gemm = measure_gemm(rows=40, in_features=128, out_features=48, repeats=1)
    assert gemm["path"] == torch.ops.dabba_cpu.w8a8_path(40, 128)
    assert gemm["gops"] == pytest.approx(2 * 40 * 128 * 48 / (gemm["ms"] / 1e3) / 1e9)
    assert measure_gemm(rows=3, in_features=128, out_features=48, repeats=1, path="scalar")["path"] == "scalar"
