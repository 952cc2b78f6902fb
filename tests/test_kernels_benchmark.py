"""benchmarks/kernels.py on tiny shapes: it runs, and reports every kernel it measures (timings
are never asserted; the benchmark prints them)."""
from __future__ import annotations

import json

from benchmarks import kernels
from dabba import native


def test_kernels_benchmark_reports_each_kernel(capsys) -> None:
    assert kernels.main(["--layers", "2", "--repeats", "1", "--linear-rows", "1,13", "--prefill-rows", "100",
                         "--decode-seqs", "3", "--decode-context", "40", "--prompt-lens", "20",
                         "--hidden", "64", "--intermediate", "128", "--num-heads", "4", "--num-kv-heads", "2",
                         "--head-dim", "16"]) == 0
    result = json.loads(capsys.readouterr().out)
    one, many = result["linear"]
    assert one["rows"] == 1 and one["bf16_f_linear_ms"] > 0 and one["int8_pack_mm_ms"] > 0
    if native.gemv_available() and native.gemm_available():
        assert one["bf16_kernel"] == "gemv" and one["bf16_native_ms"] > 0
        assert many["bf16_kernel"] == "gemm" and many["bf16_native_gflop_s"] > 0  # 13 rows: past the GEMV
        assert one["int8_kernel"] == "gemv" and many["int8_kernel"] == "gemm" and many["int8_native_ms"] > 0
        assert native.INT8_GEMM_MIN_ROWS <= 13  # (the case above)
    assert result["int8_prefill"][0]["rows"] == 100 and result["int8_prefill"][0]["dequantize_linear_ms"] > 0
    if native.load_cpu_ops():
        attention = result["attention"]
        assert attention["decode_shuffled"]["seqs"] == 3 and attention["decode_in_order"]["step_ms"] > 0
        assert attention["prompt"][0]["tokens"] == 20 and attention["prompt"][0]["layer_us"] > 0
