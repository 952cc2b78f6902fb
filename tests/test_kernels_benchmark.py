"""benchmarks/kernels.py on tiny shapes: it reports every kernel it measures, names the kernel the
thresholds give each row count, and checked that kernel against the op it is timed against
(timings themselves are never asserted; the benchmark prints them)."""
from __future__ import annotations

import json

from benchmarks import kernels
from dabba.ops import native


def test_kernels_benchmark_reports_each_kernel(capsys) -> None:
    assert kernels.main(["--layers", "2", "--repeats", "1", "--linear-rows", "1,7,13,300", "--prefill-rows", "100",
                         "--decode-seqs", "3", "--decode-context", "40", "--prompt-lens", "20", "--encoder-lens", "70",
                         "--hidden", "64", "--intermediate", "128", "--num-heads", "4", "--num-kv-heads", "2",
                         "--head-dim", "16"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [row["rows"] for row in result["linear"]] == [1, 7, 13, 300]
    assert [row["rows"] for row in result["int8_prefill"]] == [100]
    assert [(row["tokens"], row["agrees"]) for row in result["encoder_attention"]] == [(70, True)]
    assert result["encoder_attention"][0]["kernel"] == ("native" if native.dense_attention_available() else "sdpa")
    assert result["int8_prefill"][0]["agrees"] is True
    assert [row["rows"] for row in result["int4_prefill"]] == [100] and result["int4_prefill"][0]["agrees"] is True
    limits = native.kernel_constants()
    amx = native.amx_usable(64)  # the GEMM on AMX tiles, with its own thresholds
    if native.gemv_available() and native.gemm_available():
        assert limits.gemv_max_rows < 13 <= limits.gemm_max_rows < 300  # the row counts above span every kernel
        assert limits.amx_gemv_max_rows < 1
        expected = ["gemm_amx"] * 3 if amx else ["gemv", "gemv", "gemm"]
        assert [row["bf16_kernel"] for row in result["linear"]] == expected + ["f_linear"]
        assert all(row["bf16_agrees"] is True for row in result["linear"])
        assert ["bf16_gemv_ms" in row for row in result["linear"]] == [True, True, False, False]  # <= gemv_max_rows
    if native.gemv_available() and not native.gemm_available():  # the avx2 build: its GEMM, else the GEMVs
        assert 13 < limits.avx2_gemm_min_rows <= 300
        assert [row["bf16_kernel"] for row in result["linear"]] == ["gemv"] * 3 + ["gemm_avx2"]
        assert [row["int8_kernel"] for row in result["linear"]] == ["gemv"] * 4
        assert all(row["bf16_agrees"] is True and row["int8_agrees"] is True for row in result["linear"])
    if native.int8_gemv_available() and native.gemm_available():
        assert limits.int8_gemv_max_rows < 7 < limits.int8_gemm_min_rows <= 13
        assert limits.int8_gemv_max_rows < limits.amx_int8_gemm_min_rows <= 7
        expected = ["gemv", "gemm_amx", "gemm_amx"] if amx else ["gemv", "pack_mm", "gemm"]
        assert [row["int8_kernel"] for row in result["linear"]] == expected + ["dequantize_linear"]
        assert all(row["int8_agrees"] is True for row in result["linear"])
    if native.load_cpu_ops():
        attention = result["attention"]
        assert {k: attention[k]["seqs"] for k in ("decode_shuffled", "decode_in_order")} == {
            "decode_shuffled": 3, "decode_in_order": 3}
        assert [p["tokens"] for p in attention["prompt"]] == [20]
    else:
        assert result["attention"] == {"skipped": "native kernels unavailable"}
