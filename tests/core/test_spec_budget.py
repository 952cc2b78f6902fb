"""Adaptive drafts (core/spec_budget.py): over the batch, the drafts whose expected tokens make a
step's tokens per second highest; a step's time by its padded rows, as measured."""
from __future__ import annotations

import pytest

from dabba.config import SchedulerConfig
from dabba.core.kv_cache_manager import KVCacheManager
from dabba.core.outputs import ModelRunnerOutput, SchedulerOutput
from dabba.core.scheduler import Scheduler
from dabba.core.spec_budget import (EXPLORE_EVERY, STALE_STEPS, RowBlocks, StepCost, draft_budgets, engine_acceptance,
                                     request_acceptance)
from tests.core.test_scheduler import BLOCK_SIZE, make_request


def test_rows_pad_to_the_kernels_blocks() -> None:
    blocks = RowBlocks(exact_rows=8, block=16)
    assert [blocks.padded(n) for n in (1, 5, 8, 9, 16, 17, 32, 33)] == [1, 5, 8, 16, 16, 32, 32, 48]
    assert RowBlocks().padded(17) == 17  # no blocking known: rows as they are


def test_the_step_cost_fits_a_line_and_keeps_measured_sizes() -> None:
    cost = StepCost(RowBlocks(exact_rows=0, block=16))
    assert cost.fit() is None
    for n in (16, 10, 16):
        cost.record(n, 0.0026)
    assert cost.fit() is None  # one padded size only: the slope is unknown
    for n in (20, 40, 64, 30):
        cost.record(n, 0.001 + 0.0001 * cost.rows.padded(n))
    a, b = cost.fit()
    assert a == pytest.approx(0.001) and b == pytest.approx(0.0001)
    cost.record(16, 0.0036)  # a slow step of 16 rows
    assert cost.seconds(cost.fit(), 12) == pytest.approx(0.0028)  # measured: its size's recent mean, not the line
    assert cost.seconds(cost.fit(), 80) == pytest.approx(sum(cost.fit()) + 79 * cost.fit()[1])  # never measured
    for _ in range(STALE_STEPS):
        cost.record(40, 0.005)
    assert cost.measured(40) and not cost.measured(16)  # unmeasured for long: the line again
    assert cost.seconds(cost.fit(), 16) == pytest.approx(cost.fit()[0] + 16 * cost.fit()[1])


def test_draft_budgets_fill_the_block_a_step_pays_for() -> None:
    cost = StepCost(RowBlocks(exact_rows=0, block=16))
    for n, seconds in ((16, 0.002), (32, 0.003), (16, 0.002), (32, 0.003)):  # a block: 1 ms, the step 1 ms more
        cost.record(n, seconds)
    assert draft_budgets(StepCost(), 16, {"a": 0.1}, 4) == {"a": 4}  # nothing measured: every draft
    # 16 requests at 16 rows: a second block pays when its 16 drafts bring more than 8 tokens
    assert set(draft_budgets(cost, 16, {f"r{i}": 0.45 for i in range(16)}, 4).values()) == {0}
    assert set(draft_budgets(cost, 16, {f"r{i}": 0.6 for i in range(16)}, 4).values()) == {1}
    # 10 requests: 6 rows of their block are free, and go to the drafts most likely accepted
    free = draft_budgets(cost, 10, {"good": 0.9, "fair": 0.5, **{f"r{i}": 0.01 for i in range(8)}}, 4)
    assert free["good"] == 4 and free["fair"] == 2 and sum(free.values()) == 6
    assert draft_budgets(cost, 1, {"a": 0.6}, 4) == {"a": 4}  # rows of a block paid for: free
    cost.record_drafting(passes=2, seconds=0.002)  # a draft model: 1 ms a pass, one pass per draft deep
    assert draft_budgets(cost, 1, {"a": 0.6}, 4) == {"a": 1}  # 1.6 tokens in 3 ms; 1.96 in 4


def test_acceptance_estimates() -> None:
    assert request_acceptance(0, 0, 0.6) == pytest.approx(0.6)  # nothing of its own yet: the engine's
    assert engine_acceptance(0, 0) == 1.0 and engine_acceptance(0, 1) == 0.5  # one rejection does not end it
    assert request_acceptance(6, 2, 0.5) == pytest.approx((6 + 2) / (8 + 4))


def decode_step(rows: dict[str, int]) -> SchedulerOutput:
    return SchedulerOutput(num_scheduled_tokens=dict.fromkeys(rows, 1), total_num_scheduled_tokens=sum(rows.values()),
                           scheduled_spec_decode_tokens={rid: [0] * (n - 1) for rid, n in rows.items() if n > 1})


def test_the_scheduler_budgets_each_requests_next_drafts() -> None:
    kv = KVCacheManager(64, BLOCK_SIZE, True, None, 64)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                             speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    scheduler = Scheduler(config, kv, 256)
    for rid in ("good", "bad"):
        scheduler.add_request(make_request(rid, 6, max_tokens=50))
    assert scheduler.schedule().spec_token_budget == {"good": 4, "bad": 4}  # no timing yet: all
    scheduler.requests["good"].spec_accepted, scheduler.requests["good"].spec_rejected = 30, 2
    scheduler.requests["bad"].spec_accepted, scheduler.requests["bad"].spec_rejected = 1, 20
    for good, bad in ((1, 1), (5, 1), (1, 5), (3, 2), (1, 1), (5, 5)):  # 5 ms + 1 ms a row: a row costs a 7th
        scheduler.record_step_time(decode_step({"good": good, "bad": bad}), ModelRunnerOutput(), 0.005 + 0.001 * (good + bad))
    out = scheduler.schedule()
    assert out.spec_token_budget == {"good": 4, "bad": 0}
    budgets = [scheduler.schedule().spec_token_budget["bad"] for _ in range(EXPLORE_EVERY)]
    assert sorted(budgets) == [0] * (EXPLORE_EVERY - 1) + [1]  # one draft now and then, to learn again
    fixed = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                            speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                "adaptive_drafts": False})
    assert not Scheduler(fixed, KVCacheManager(64, BLOCK_SIZE), 256).schedule().spec_token_budget
