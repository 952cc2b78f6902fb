"""Adaptive drafts (core/spec_budget.py): a request verifies the drafts expected to pay for the step
time they add; the step's cost per token comes from a least-squares fit of measured step times."""
from __future__ import annotations

import pytest

from dabba.config import SchedulerConfig
from dabba.core.kv_cache_manager import KVCacheManager
from dabba.core.scheduler import Scheduler
from dabba.core.spec_budget import EXPLORE_EVERY, StepCost, engine_acceptance, request_acceptance, worth_verifying
from tests.core.test_scheduler import BLOCK_SIZE, make_request


def test_the_fit_recovers_a_linear_step_time() -> None:
    cost = StepCost()
    assert cost.fit() is None and cost.draft_threshold(16) == 0.0  # nothing measured: every draft
    for n in (16, 16, 16):
        cost.record(n, 0.005 + 0.0001 * n)
    assert cost.fit() is None  # one size only: the slope is unknown
    for n in (40, 80, 20, 64):
        cost.record(n, 0.005 + 0.0001 * n)
    a, b = cost.fit()
    assert a == pytest.approx(0.005) and b == pytest.approx(0.0001)
    assert cost.draft_threshold(16) == pytest.approx(0.0016 / 0.0066)


def test_drafts_worth_verifying() -> None:
    assert worth_verifying(4, 0.42, 0.0) == 4  # free drafts: all of them
    assert worth_verifying(4, 0.42, 0.246) == 1  # 0.42 > 0.246 > 0.42^2
    assert worth_verifying(4, 0.9, 0.246) == 4  # 0.9^4 = 0.66
    assert worth_verifying(9, 0.9, 0.5) == 6  # 0.9^6 = 0.53 > 0.5 > 0.9^7
    assert worth_verifying(4, 0.2, 0.246) == 0
    assert worth_verifying(4, 1.0, 0.9) == 4
    assert request_acceptance(0, 0, 0.6) == pytest.approx(0.6)  # nothing of its own yet: the engine's
    assert engine_acceptance(0, 0) == 1.0 and engine_acceptance(0, 1) == 0.5  # one rejection does not end it
    assert request_acceptance(6, 2, 0.5) == pytest.approx((6 + 2) / (8 + 4))


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
    for n in (2, 4, 8, 12, 2, 10):  # a step costs 5 ms + 1 ms a token: a token is a fifth of a 2-request step
        scheduler.record_step_time(n, 0.005 + 0.001 * n)
    out = scheduler.schedule()
    assert out.spec_token_budget == {"good": 4, "bad": 0}
    budgets = [scheduler.schedule().spec_token_budget["bad"] for _ in range(EXPLORE_EVERY)]
    assert sorted(budgets) == [0] * (EXPLORE_EVERY - 1) + [1]  # one draft now and then, to learn again
    fixed = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                            speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                "adaptive_drafts": False})
    assert not Scheduler(fixed, KVCacheManager(64, BLOCK_SIZE), 256).schedule().spec_token_budget
