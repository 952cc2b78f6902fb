"""benchmarks/kv_memory.py: the contiguous baseline's arithmetic, paging beating it on a small trace,
and the decode-speed comparison by KV-cache dtype running every configuration (no timing asserted)."""
from __future__ import annotations

import pytest

from benchmarks.kv_memory import Trace, compare_decode_speed, make_trace, run_contiguous, run_paged, summarize
from dabba.config import DEMO_MODEL
from dabba.ops.native import load_cpu_ops


def test_contiguous_baseline_by_hand() -> None:
    # 2 reservations of 10 slots fit in 25; request 2 waits for request 0 to finish
    trace = Trace(prompts=[[1] * 3, [1] * 5, [1] * 2], output_lens=[2, 4, 1])
    result = run_contiguous(trace, total_slots=25, max_model_len=10)
    assert result["capacity"] == 2
    held = [(s["running"], s["tokens_stored"]) for s in result["steps"]]
    # step 1: both decode (4 + 6); step 2: request 0 reaches 5 = 3 + 2 and leaves, 1 holds 7;
    # step 3: request 2 joins (2 -> 3, done), 1 holds 8; step 4: 1 reaches 9 = 5 + 4 and leaves
    assert held == [(2, 10), (1, 7), (1, 8), (0, 0)]
    assert summarize(result["steps"][:3])["used_by_real_tokens_pct"] == 100 * 25 / 40


def test_paging_wastes_little_on_a_mixed_trace() -> None:
    trace = make_trace(12, 4096, 256, shared_prefix=0, seed=1)
    paged = run_paged(DEMO_MODEL, trace, kv_cache_memory=100 * 16 * 3072, max_model_len=256)  # 100 blocks
    contiguous = run_contiguous(trace, paged["total_slots"], 256)
    p, c = summarize(paged["steps"]), summarize(contiguous["steps"])
    assert p["waste_pct"] < 10 < c["waste_pct"]
    assert p["max_running"] > contiguous["capacity"] == 1600 // 256


@pytest.mark.skipif(not load_cpu_ops(), reason="native CPU kernels cannot be built here")
def test_decode_speed_comparison_runs_every_configuration() -> None:
    result = compare_decode_speed(DEMO_MODEL, seqs=2, context=40, rounds=1, repeats=1, engine_steps=2,
                                  attention_layers=2)
    names = {"bf16 cpu", "int8 cpu", "fp8 cpu", "int8 torch_ref", "fp8 torch_ref"}
    for section in ("attention_step", "engine_decode_step"):
        rows = {name: row for name, row in result[section].items() if isinstance(row, dict)}
        assert set(rows) == names
        assert all(row["wall_ms"] > 0 for row in rows.values())
        assert rows["bf16 cpu"]["wall_vs_bf16_native"] == 1.0
