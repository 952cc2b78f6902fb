"""benchmarks/layer_loop.py: both layer loops in one process, on a tiny Gemma 3 checkpoint."""
from __future__ import annotations

import pytest

from dabba.ops.native import load_cpu_ops


@pytest.mark.skipif(not load_cpu_ops(), reason="native CPU kernels cannot be built here")
def test_the_loops_run_side_by_side_and_agree(checkpoints) -> None:
    from benchmarks.layer_loop import run

    result = run(str(checkpoints["gemma3"].path), batch_size=3, input_len=20, output_len=6, rounds=2,
                 quantization="int8")
    assert result["same_tokens"] is True
    assert all(len(rates) == 2 and min(rates) > 0 for rates in result["decode_tok_s"].values())
    assert result["median_native_over_python"] > 0
