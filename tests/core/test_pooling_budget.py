"""Pooling requests beside decoding ones: a step takes only the pooling tokens that keep it within
the slowdown of a decode-only step (core/pooling_budget.py), with step times given, not measured."""
from __future__ import annotations

import itertools

import pytest

from dabba.config import SchedulerConfig
from dabba.core.kv_cache_manager import KVCacheManager
from dabba.core.outputs import ModelRunnerOutput
from dabba.core.pooling_budget import FIRST_TOKENS, REFRESH_EVERY, PoolingBudget
from dabba.core.request import Request
from dabba.core.scheduler import Scheduler
from dabba.pooling_params import PoolingParams
from dabba.sampling_params import SamplingParams

DECODE_S, TOKEN_S = 0.010, 0.001  # a decode-only step, and each pooling token on top of it


def test_the_budget_follows_the_measured_costs() -> None:
    budget = PoolingBudget(slowdown=1.25)
    assert budget.tokens() == 0  # the decodes' own time first
    budget.record(decode_rows=4, pooling_tokens=0, prefill_tokens=0, seconds=DECODE_S)
    assert budget.tokens() == FIRST_TOKENS
    budget.record(4, FIRST_TOKENS, 0, DECODE_S + FIRST_TOKENS * TOKEN_S)
    assert budget.tokens() == 2  # 0.25 * 10 ms of 1 ms tokens
    budget.record(4, 2, 100, 1.0)  # a generation prompt ran too: no lesson
    budget.record(0, 50, 0, 1.0)  # nothing decoded: no lesson
    assert (budget.decode_seconds, budget.token_seconds) == (DECODE_S, pytest.approx(TOKEN_S))
    budget.record(4, 0, 0, 2 * DECODE_S)  # contexts grew: decodes take longer, more tokens fit
    assert budget.decode_seconds == pytest.approx(0.8 * DECODE_S + 0.2 * 2 * DECODE_S)
    assert budget.tokens() == 3
    for _ in range(REFRESH_EVERY):
        assert budget.tokens() > 0
        budget.record(4, 3, 0, budget.decode_seconds + 3 * TOKEN_S)
    assert budget.tokens() == 0  # a decode-only step keeps the decodes' time fresh
    budget.record(4, 0, 0, DECODE_S)
    assert budget.tokens() > 0
    budget.restart()  # pooling requests again after none: the decodes' time is measured afresh
    assert budget.tokens() == 0
    budget.record(4, 0, 0, DECODE_S)
    assert budget.tokens() == 2  # a token's cost is still known


_first_id = itertools.count(100, 1000)


def _request(request_id: str, prompt_len: int, pooling: bool) -> Request:
    """Prompts of ids no other request has: nothing comes from the prefix cache."""
    first = next(_first_id)
    params = SamplingParams(max_tokens=1 if pooling else 200, ignore_eos=True)
    return Request(request_id, list(range(first, first + prompt_len)), params, eos_token_ids=frozenset({2}),
                   block_size=4, pooling_params=PoolingParams() if pooling else None)


def _step(scheduler: Scheduler) -> dict[str, int]:
    """One step, its time as DECODE_S plus TOKEN_S a pooling token; what it scheduled."""
    out = scheduler.schedule()
    runner_out = ModelRunnerOutput()
    pooling_tokens = 0
    for rid, n in out.num_scheduled_tokens.items():
        request = scheduler.requests[rid]
        if request.pooling_params is not None:
            pooling_tokens += n
        if request.num_computed_tokens + n >= request.num_tokens:
            if request.pooling_params is not None:
                runner_out.pooler_output[rid] = [0.0]
            else:
                runner_out.sampled_token_ids[rid] = [1000]
    scheduler.update_from_output(out, runner_out)
    scheduler.record_step_time(out, runner_out, DECODE_S + TOKEN_S * pooling_tokens)
    return dict(out.num_scheduled_tokens)


def test_pooling_tokens_are_rationed_while_requests_decode() -> None:
    config = SchedulerConfig(max_num_batched_tokens=64, pooling_decode_slowdown=1.25)
    scheduler = Scheduler(config, KVCacheManager(256, 4, True, None, 64), 256)
    for i in range(2):
        scheduler.add_request(_request(f"chat{i}", 8, False))
    assert _step(scheduler) == {"chat0": 8, "chat1": 8}  # prompts: nothing decodes yet
    scheduler.add_request(_request("embed", 30, True))
    scheduler.add_request(_request("chat2", 8, False))  # behind the embedding, which may not hold it up
    assert _step(scheduler) == {"chat0": 1, "chat1": 1, "chat2": 8}  # the decodes' own time first,
    assert _step(scheduler) == {"chat0": 1, "chat1": 1, "chat2": 1}  # measured without a prompt
    assert _step(scheduler) == {"chat0": 1, "chat1": 1, "chat2": 1, "embed": FIRST_TOKENS}
    steps = [_step(scheduler) for _ in range(7)]
    assert [s["embed"] for s in steps] == [2] * 7  # 0.25 * DECODE_S / TOKEN_S
    assert all(s["chat0"] == s["chat1"] == s["chat2"] == 1 for s in steps)
    assert "embed" not in scheduler.requests  # 16 + 7 * 2 = 30 tokens: done
    assert scheduler.num_pooling_requests == 0
    for rid in ("chat0", "chat1", "chat2"):
        scheduler.abort_request(rid)
    scheduler.add_request(_request("embed2", 40, True))
    assert _step(scheduler) == {"embed2": 40}  # nothing decodes: the whole budget


def test_no_limit_when_the_slowdown_is_zero() -> None:
    config = SchedulerConfig(max_num_batched_tokens=64, pooling_decode_slowdown=0.0)
    scheduler = Scheduler(config, KVCacheManager(256, 4, True, None, 64), 256)
    scheduler.add_request(_request("chat", 8, False))
    _step(scheduler)
    scheduler.add_request(_request("embed", 30, True))
    assert _step(scheduler) == {"chat": 1, "embed": 30}
