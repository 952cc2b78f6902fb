"""benchmarks/gguf_kernels.py on tiny shapes: it reports every type and row count it was asked
for, with the bytes it read (timings themselves are never asserted; the benchmark prints them)."""
from __future__ import annotations

import json

import pytest

from benchmarks import gguf_kernels
from dabba.ops import native

pytestmark = pytest.mark.skipif(not native.load_cpu_ops(), reason="native CPU kernels unavailable")


def test_the_benchmark_reports_each_type_and_row_count(capsys) -> None:
    assert gguf_kernels.main(["--types", "Q4_K,Q4_0,INT8,INT4", "--layers", "2", "--rows", "1,9", "--repeats", "1",
                              "--hidden", "256", "--intermediate", "512", "--num-heads", "4", "--num-kv-heads", "2",
                              "--head-dim", "64", "--membw-gib", "0.05"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["layer_shapes"] == [[512, 256], [256, 256], [1024, 256], [256, 512]]
    assert [t["type"] for t in result["types"]] == ["Q4_K", "Q4_0", "INT8", "INT4"]
    weights, rows = 2 * (512 * 256 + 256 * 256 + 1024 * 256 + 256 * 512), 2 * (512 + 256 + 1024 + 256)
    assert result["types"][0]["mb"] == round(weights * 144 / 256 / 1e6, 1)  # Q4_K: 144 bytes a 256 values
    assert result["types"][2]["mb"] == round((weights + 2 * rows) / 1e6, 1)  # INT8: a code each, a bf16 scale a row
    assert result["types"][3]["mb"] == round((weights / 2 + weights / 128 * 4) / 1e6, 1)  # INT4: + 2 bf16 a group
    assert all(set(t["rows"]) == {"1", "9"} and all(r["gb_s"] > 0 for r in t["rows"].values())
               for t in result["types"])


def test_an_unknown_type_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit):
        gguf_kernels.main(["--types", "Q2_K"])
    assert "unknown ['Q2_K']" in capsys.readouterr().err
