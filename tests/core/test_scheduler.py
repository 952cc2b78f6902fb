"""Scheduler: one token budget per step, running requests first, preemption by recompute.

Every step goes through ``FakeWorker``, which keeps what a model runner keeps (token ids, block
table, computed count) from the ``SchedulerOutput`` alone and samples a token for each request
that reached the end of its known tokens. After each step ``run_step`` checks that the worker's
view equals the scheduler's, that the EngineCoreOutputs hold exactly the sampled tokens, and that
the KV bookkeeping is intact, so every test also checks the core -> worker and core -> engine
contracts. Block size 4 throughout.
"""
from __future__ import annotations

import itertools
import random
from typing import Callable

import pytest

from dabba.config import SchedulerConfig
from dabba.core.kv_cache_groups import KVCacheGroup
from dabba.core.kv_cache_manager import KVCacheManager, cdiv
from dabba.core.outputs import (CachedRequestData, EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput,
                                NewRequestData, SchedulerOutput, TokenLogprobs)
from dabba.core.request import Request, RequestStatus
from dabba.core.scheduler import Scheduler
from dabba.core.stats import SchedulerStats
from dabba.sampling_params import SamplingParams

BLOCK_SIZE = 4
EOS = 2
_fresh_token = itertools.count(10_000)


def fresh_tokens(n: int) -> list[int]:
    """Token ids no other call returns: no accidental prefix sharing between requests."""
    return [next(_fresh_token) for _ in range(n)]


def default_sample(request_id: str, output_index: int) -> int:
    """The k-th output token of every request is 1000 + k: never EOS, never a prompt token."""
    return 1000 + output_index


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_caching: bool = True,
    groups: tuple[KVCacheGroup, ...] | None = None,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching, groups, max_num_batched_tokens)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, kv, max_model_len)


def make_request(
    request_id: str,
    prompt: int | list[int],
    max_tokens: int = 4,
    *,
    priority: int = 0,
    stop_token_ids: tuple[int, ...] = (),
    ignore_eos: bool = False,
) -> Request:
    """``prompt`` is token ids, or a length for fresh ones."""
    prompt_token_ids = fresh_tokens(prompt) if isinstance(prompt, int) else list(prompt)
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
    return Request(request_id, prompt_token_ids, params, eos_token_ids=frozenset({EOS}), priority=priority,
                   block_size=BLOCK_SIZE)


class FakeWorker:
    """What a model runner keeps per request, built from SchedulerOutput alone."""

    def __init__(self, sample: Callable[[str, int], int] = default_sample) -> None:
        self.sample = sample
        self.token_ids: dict[str, list[int]] = {}
        self.num_prompt_tokens: dict[str, int] = {}
        self.num_computed_tokens: dict[str, int] = {}
        self.block_ids: dict[str, tuple[list[int], ...]] = {}  # per KV-cache group

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in out.finished_req_ids:
            for table in (self.token_ids, self.num_prompt_tokens, self.num_computed_tokens, self.block_ids):
                table.pop(request_id, None)
        for new in out.scheduled_new_reqs:
            assert new.request_id not in self.token_ids, f"{new.request_id} sent as new twice"
            self.token_ids[new.request_id] = list(new.token_ids)
            self.num_prompt_tokens[new.request_id] = len(new.token_ids) - new.num_output_tokens
            self.num_computed_tokens[new.request_id] = new.num_computed_tokens
            self.block_ids[new.request_id] = tuple(list(table) for table in new.block_ids)
        for cached in out.scheduled_cached_reqs:
            assert cached.num_computed_tokens == self.num_computed_tokens[cached.request_id]
            for table, new_ids in zip(self.block_ids[cached.request_id], cached.new_block_ids):
                table.extend(new_ids)
        sampled = {}
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            self.num_computed_tokens[request_id] += num_tokens
            num_computed = self.num_computed_tokens[request_id]
            tokens = self.token_ids[request_id]
            assert num_computed <= len(tokens)
            assert all(cdiv(num_computed, BLOCK_SIZE) <= len(t) for t in self.block_ids[request_id]), "no slot"
            if num_computed == len(tokens):
                token_id = self.sample(request_id, len(tokens) - self.num_prompt_tokens[request_id])
                tokens.append(token_id)
                sampled[request_id] = [token_id]
        return ModelRunnerOutput(sampled_token_ids=sampled)


def run_step(scheduler: Scheduler, worker: FakeWorker) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    """schedule -> worker -> update_from_output, checking the invariants every step must keep."""
    config = scheduler.config
    out = scheduler.schedule()
    scheduled = out.num_scheduled_tokens
    assert out.total_num_scheduled_tokens == sum(scheduled.values()) <= config.max_num_batched_tokens
    assert len(scheduled) <= config.max_num_seqs
    assert all(n > 0 for n in scheduled.values())
    assert list(scheduled) == [c.request_id for c in out.scheduled_cached_reqs] + [
        n.request_id for n in out.scheduled_new_reqs]
    assert not (out.finished_req_ids & set(scheduled))

    runner_out = worker.execute(out)
    core_outputs = scheduler.update_from_output(out, runner_out)
    # The engine hears of each sampled token once, in batch order (the FakeWorker sends no logprobs).
    assert [(o.request_id, o.new_token_ids) for o in core_outputs.outputs] == [
        (rid, runner_out.sampled_token_ids[rid]) for rid in scheduled if rid in runner_out.sampled_token_ids]

    kv = scheduler.kv_cache_manager
    kv.check_integrity()
    assert scheduler.running == sorted(scheduler.running, key=Request.sort_key)
    assert scheduler.waiting == sorted(scheduler.waiting, key=Request.sort_key)
    for request in scheduler.running:
        rid = request.request_id
        assert request.status == RequestStatus.RUNNING
        # The worker's tables equal the manager's, but for blocks a sliding window has passed:
        # the manager frees them (null block), the worker keeps their stale ids, never read.
        null = kv.pool.null_block
        for theirs, ours in zip(worker.block_ids[rid], kv.get_block_ids(rid), strict=True):
            assert len(theirs) == len(ours)
            assert all(w == k or (null is not None and k == null.block_id) for w, k in zip(theirs, ours))
        assert worker.token_ids[rid] == request.all_token_ids
        assert worker.num_computed_tokens[rid] == request.num_computed_tokens
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert kv.get_block_ids(request.request_id) == ([],)
    return out, core_outputs


def run_to_completion(scheduler: Scheduler, worker: FakeWorker, max_steps: int = 500) -> list[SchedulerOutput]:
    outs = []
    while scheduler.has_unfinished_requests():
        assert len(outs) < max_steps, "no progress"
        out, _ = run_step(scheduler, worker)
        assert not out.is_empty, "a step with unfinished requests scheduled nothing"
        outs.append(out)
    return outs


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    assert kv.pool.num_free_blocks == kv.num_usable_blocks
    assert kv.req_to_blocks == {}
    assert scheduler.requests == {}
    kv.check_integrity()


def new_ids(out: SchedulerOutput) -> list[str]:
    return [n.request_id for n in out.scheduled_new_reqs]


# ---- one request -----------------------------------------------------------------------------

def test_one_request_prefills_then_decodes_until_max_tokens():
    scheduler, worker = make_scheduler(num_blocks=8), FakeWorker()
    a = make_request("a", 6, max_tokens=3)
    scheduler.add_request(a)
    assert scheduler.waiting == [a]

    out, updated = run_step(scheduler, worker)
    assert out.scheduled_new_reqs == [
        NewRequestData("a", a.prompt_token_ids, a.sampling_params, block_ids=([0, 1],), num_computed_tokens=0,
                       num_output_tokens=0, eos_token_ids=frozenset({EOS}))]
    assert out.scheduled_cached_reqs == []
    assert out.num_scheduled_tokens == {"a": 6}
    assert out.finished_req_ids == set()
    assert updated.outputs == [EngineCoreOutput("a", [1000], num_cached_tokens=0)]
    assert (a.status, a.num_computed_tokens, a.num_cached_tokens, a.output_token_ids) == (
        RequestStatus.RUNNING, 6, 0, [1000])

    out, _ = run_step(scheduler, worker)
    assert out.scheduled_cached_reqs == [CachedRequestData("a", new_block_ids=([],), num_computed_tokens=6)]
    assert out.num_scheduled_tokens == {"a": 1}

    out, updated = run_step(scheduler, worker)
    assert out.scheduled_cached_reqs == [CachedRequestData("a", new_block_ids=([],), num_computed_tokens=7)]
    assert updated.outputs == [EngineCoreOutput("a", [1002], finish_reason="length")]
    assert a.output_token_ids == [1000, 1001, 1002]
    assert (a.status, a.status.finish_reason, a.stop_reason) == (RequestStatus.FINISHED_LENGTH, "length", None)
    assert scheduler.running == [] and not scheduler.has_unfinished_requests()
    assert_all_blocks_free(scheduler)
    assert list(scheduler.kv_cache_manager.pool.free_queue) == [2, 3, 4, 5, 6, 7, 1, 0]

    # The worker hears about the finish on the next step, and only then.
    out = scheduler.schedule()
    assert (out.finished_req_ids, out.num_scheduled_tokens, out.is_empty) == ({"a"}, {}, True)
    assert scheduler.schedule().finished_req_ids == set()


# ---- the token budget ----------------------------------------------------------------------

def test_long_prompt_is_prefilled_in_chunks_of_the_token_budget():
    scheduler, worker = make_scheduler(num_blocks=8, max_num_batched_tokens=8), FakeWorker()
    a = make_request("a", 20, max_tokens=2)
    scheduler.add_request(a)

    out, updated = run_step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 8}
    assert out.scheduled_new_reqs[0].block_ids == ([0, 1],)
    assert updated.outputs == [] and a.output_token_ids == []  # mid-prompt: nothing sampled

    expected = [  # (new block ids, num_computed_tokens before the step, tokens this step)
        ([2, 3], 8, 8),
        ([4], 16, 4),  # reaches the end of the prompt: samples
        ([5], 20, 1),  # decode of token 20 opens block 5
    ]
    for new_block_ids, num_computed, num_tokens in expected:
        out, _ = run_step(scheduler, worker)
        assert out.scheduled_cached_reqs == [CachedRequestData("a", (new_block_ids,), num_computed)]
        assert out.num_scheduled_tokens == {"a": num_tokens}
    assert a.output_token_ids == [1000, 1001]
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert_all_blocks_free(scheduler)


def test_running_requests_are_served_first_then_new_prefills_fill_the_budget():
    scheduler, worker = make_scheduler(max_num_batched_tokens=8), FakeWorker()
    a = make_request("a", 4, max_tokens=5)
    scheduler.add_request(a)
    run_step(scheduler, worker)
    b = make_request("b", 10, max_tokens=2)
    scheduler.add_request(b)

    out, _ = run_step(scheduler, worker)  # a's decode, then 7 tokens of b's prompt
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 7)]
    assert out.scheduled_cached_reqs == [CachedRequestData("a", new_block_ids=([1],), num_computed_tokens=4)]
    assert out.scheduled_new_reqs[0].block_ids == ([2, 3],)

    out, _ = run_step(scheduler, worker)  # a's decode and the rest of b's prompt
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 3)]
    assert out.scheduled_cached_reqs == [CachedRequestData("a", ([],), 5), CachedRequestData("b", ([4],), 7)]
    assert b.output_token_ids == [1000]

    run_to_completion(scheduler, worker)
    assert a.output_token_ids == [1000, 1001, 1002, 1003, 1004]
    assert b.output_token_ids == [1000, 1001]
    assert_all_blocks_free(scheduler)


def test_running_requests_are_served_in_priority_order_until_the_budget_runs_out():
    scheduler, worker = make_scheduler(max_num_batched_tokens=4), FakeWorker()
    chat = make_request("chat", 1, max_tokens=8)
    scheduler.add_request(chat)
    run_step(scheduler, worker)
    urgent = make_request("urgent", 12, max_tokens=1, priority=-1)
    scheduler.add_request(urgent)

    steps = [list(run_step(scheduler, worker)[0].num_scheduled_tokens.items()) for _ in range(4)]
    assert steps == [
        [("chat", 1), ("urgent", 3)],  # urgent was still waiting: the running decode goes first
        [("urgent", 4)],  # urgent now runs ahead of chat and spends the whole budget
        [("urgent", 4)],
        [("urgent", 1), ("chat", 1)],
    ]
    assert urgent.output_token_ids == [1000]
    assert chat.output_token_ids == [1000, 1001, 1002]
    run_to_completion(scheduler, worker)
    assert_all_blocks_free(scheduler)


def test_the_budget_is_split_exactly_across_decodes_chunks_and_new_prompts():
    scheduler, worker = make_scheduler(max_num_batched_tokens=12), FakeWorker()
    for rid in "abcde":
        scheduler.add_request(make_request(rid, 5, max_tokens=3))

    out, _ = run_step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 5, "b": 5, "c": 2}
    assert [n.block_ids[0] for n in out.scheduled_new_reqs] == [[0, 1], [2, 3], [4]]

    out, _ = run_step(scheduler, worker)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("c", 3), ("d", 5), ("e", 2)]
    assert out.total_num_scheduled_tokens == 12
    assert [c.new_block_ids[0] for c in out.scheduled_cached_reqs] == [[], [], [5]]
    assert [n.block_ids[0] for n in out.scheduled_new_reqs] == [[6, 7], [8]]

    run_to_completion(scheduler, worker)
    assert_all_blocks_free(scheduler)


def test_max_num_seqs_caps_the_running_requests():
    scheduler, worker = make_scheduler(max_num_seqs=2), FakeWorker()
    for rid in "abc":
        scheduler.add_request(make_request(rid, 3, max_tokens=2))

    out, _ = run_step(scheduler, worker)
    assert new_ids(out) == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    out, _ = run_step(scheduler, worker)  # a and b finish; c is not admitted while they run
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    out, _ = run_step(scheduler, worker)
    assert out.finished_req_ids == {"a", "b"}
    assert new_ids(out) == ["c"]
    run_to_completion(scheduler, worker)
    assert_all_blocks_free(scheduler)


# ---- priority --------------------------------------------------------------------------------

def test_a_lower_priority_value_is_admitted_first_and_ties_are_fcfs():
    scheduler, worker = make_scheduler(max_num_seqs=1), FakeWorker()
    for rid, priority in [("r1", 1), ("r2", 0), ("r3", 0), ("r4", 1)]:
        scheduler.add_request(make_request(rid, 2, max_tokens=1, priority=priority))
    admitted = [new_ids(out) for out in run_to_completion(scheduler, worker)]
    assert admitted == [["r2"], ["r3"], ["r1"], ["r4"]]
    assert_all_blocks_free(scheduler)


def test_priority_orders_admission_and_decodes_within_one_step():
    scheduler, worker = make_scheduler(), FakeWorker()
    for rid, priority in [("r1", 1), ("r2", 0), ("r3", 0), ("r4", 1)]:
        scheduler.add_request(make_request(rid, 2, max_tokens=2, priority=priority))
    out, _ = run_step(scheduler, worker)
    assert new_ids(out) == ["r2", "r3", "r1", "r4"]
    assert [n.block_ids[0] for n in out.scheduled_new_reqs] == [[0], [1], [2], [3]]
    out, _ = run_step(scheduler, worker)
    assert list(out.num_scheduled_tokens) == ["r2", "r3", "r1", "r4"]
    assert_all_blocks_free(scheduler)


# ---- preemption ----------------------------------------------------------------------------

def test_the_newest_request_is_preempted_and_resumed_with_its_output_kept():
    scheduler, worker = make_scheduler(num_blocks=4), FakeWorker()
    kv = scheduler.kv_cache_manager
    a = make_request("a", 7, max_tokens=6)
    b = make_request("b", 7, max_tokens=6)
    scheduler.add_request(a)
    scheduler.add_request(b)

    out, _ = run_step(scheduler, worker)
    assert [n.block_ids[0] for n in out.scheduled_new_reqs] == [[0, 1], [2, 3]]
    out, _ = run_step(scheduler, worker)  # both decode the 8th token: still 2 blocks each
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}

    # a's 9th token needs a 3rd block and none is free: b (newest) is preempted, its blocks go
    # to the queue last block first ([3, 2]) and a takes block 3, evicting b's cached block.
    out, _ = run_step(scheduler, worker)
    assert out.finished_req_ids == {"b"}
    assert out.scheduled_cached_reqs == [CachedRequestData("a", new_block_ids=([3],), num_computed_tokens=8)]
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.scheduled_new_reqs == []  # no admission in a step that had to preempt
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert b.output_token_ids == [1000, 1001]
    assert scheduler.waiting == [b] and scheduler.running == [a]
    assert scheduler.num_preemptions == 1
    assert kv.get_block_ids("a") == ([0, 1, 3],)
    assert kv.get_block_ids("b") == ([],)
    assert list(kv.pool.free_queue) == [2]
    assert kv.pool.num_evictions == 1
    assert scheduler.get_stats() == SchedulerStats(
        num_running_reqs=1, num_waiting_reqs=1, kv_cache_usage=0.75, prefix_cache_hit_rate=0.0, num_preemptions=1,
        kv_blocks_total=4, kv_blocks_used=3, kv_slots_allocated=12, kv_tokens_stored=9, prefix_cache_hit_tokens=0,
        prefix_cache_queried_tokens=14)

    # b would hit its block 2 and need 2 more: it waits until a finishes (3 more steps).
    for _ in range(3):
        out, _ = run_step(scheduler, worker)
        assert out.num_scheduled_tokens == {"a": 1}
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert list(kv.pool.free_queue) == [2, 3, 1, 0]

    # b comes back whole: prompt + its 2 outputs, hitting its own first block.
    out, _ = run_step(scheduler, worker)
    assert out.finished_req_ids == {"a"}
    assert out.scheduled_new_reqs == [
        NewRequestData("b", b.prompt_token_ids + [1000, 1001], b.sampling_params, block_ids=([2, 3, 1],),
                       num_computed_tokens=4, num_output_tokens=2, eos_token_ids=frozenset({EOS}))]
    assert out.num_scheduled_tokens == {"b": 5}
    assert (kv.prefix_stats.num_queried_tokens, kv.prefix_stats.num_hit_tokens) == (7 + 7 + 9, 4)
    assert b.num_cached_tokens == 0  # the hit at first scheduling

    run_to_completion(scheduler, worker)
    assert a.output_token_ids == b.output_token_ids == [1000, 1001, 1002, 1003, 1004, 1005]
    assert (a.num_preemptions, b.num_preemptions, scheduler.num_preemptions) == (0, 1, 1)
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert_all_blocks_free(scheduler)


def test_only_as_many_requests_as_needed_are_preempted():
    scheduler, worker = make_scheduler(num_blocks=6), FakeWorker()
    requests = [make_request(rid, 7, max_tokens=6) for rid in "abc"]
    for request in requests:
        scheduler.add_request(request)
    run_step(scheduler, worker)
    run_step(scheduler, worker)
    # c's blocks [4, 5] are freed as [5, 4]: a takes 5, b takes 4.
    out, _ = run_step(scheduler, worker)
    assert out.finished_req_ids == {"c"}
    assert out.scheduled_cached_reqs == [CachedRequestData("a", ([5],), 8), CachedRequestData("b", ([4],), 8)]
    assert scheduler.num_preemptions == 1
    run_to_completion(scheduler, worker)
    assert scheduler.num_preemptions == 1
    assert [r.output_token_ids for r in requests] == [[1000, 1001, 1002, 1003, 1004, 1005]] * 3
    assert_all_blocks_free(scheduler)


def test_the_victim_is_the_lowest_priority_not_the_newest():
    scheduler, worker = make_scheduler(num_blocks=4), FakeWorker()
    low = make_request("low", 7, max_tokens=6, priority=1)  # older, but less urgent
    high = make_request("high", 7, max_tokens=6, priority=0)
    scheduler.add_request(low)
    scheduler.add_request(high)
    out, _ = run_step(scheduler, worker)
    assert new_ids(out) == ["high", "low"]
    run_step(scheduler, worker)
    out, _ = run_step(scheduler, worker)
    assert out.finished_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"high": 1}
    assert (low.status, high.status) == (RequestStatus.PREEMPTED, RequestStatus.RUNNING)
    run_to_completion(scheduler, worker)
    assert low.output_token_ids == high.output_token_ids == [1000, 1001, 1002, 1003, 1004, 1005]
    assert_all_blocks_free(scheduler)


def test_no_request_is_admitted_in_a_step_that_had_to_preempt():
    scheduler, worker = make_scheduler(num_blocks=4), FakeWorker()
    for rid in "ab":
        scheduler.add_request(make_request(rid, 7, max_tokens=6))
    run_step(scheduler, worker)
    run_step(scheduler, worker)
    urgent = make_request("urgent", 1, max_tokens=1, priority=-1)  # would fit the block b frees
    scheduler.add_request(urgent)
    out, _ = run_step(scheduler, worker)
    assert out.finished_req_ids == {"b"}
    assert out.scheduled_new_reqs == []
    assert [r.request_id for r in scheduler.waiting] == ["urgent", "b"]
    out, _ = run_step(scheduler, worker)  # memory was not tight this step: urgent gets block 2
    assert out.num_scheduled_tokens == {"a": 1, "urgent": 1}
    assert out.scheduled_new_reqs[0].block_ids == ([2],)
    run_to_completion(scheduler, worker)
    assert scheduler.num_preemptions == 1
    assert_all_blocks_free(scheduler)


def test_a_request_that_is_itself_the_newest_preempts_itself():
    scheduler, worker = make_scheduler(num_blocks=4), FakeWorker()
    a = make_request("a", 6, max_tokens=4)
    b = make_request("b", 7, max_tokens=4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    run_step(scheduler, worker)
    run_step(scheduler, worker)
    # a (8 tokens) still fits its 2 blocks; b's 9th token needs a 3rd: b is the last running.
    out, _ = run_step(scheduler, worker)
    assert out.finished_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    assert (b.status, b.output_token_ids) == (RequestStatus.PREEMPTED, [1000, 1001])
    out, _ = run_step(scheduler, worker)  # a takes block 3 and finishes; b cannot fit yet
    assert out.scheduled_cached_reqs == [CachedRequestData("a", ([3],), 8)]
    assert out.scheduled_new_reqs == []
    out, _ = run_step(scheduler, worker)
    assert out.scheduled_new_reqs == [
        NewRequestData("b", b.prompt_token_ids + [1000, 1001], b.sampling_params, block_ids=([2, 3, 1],),
                       num_computed_tokens=4, num_output_tokens=2, eos_token_ids=frozenset({EOS}))]
    run_to_completion(scheduler, worker)
    assert b.output_token_ids == [1000, 1001, 1002, 1003]
    assert scheduler.num_preemptions == 1
    assert_all_blocks_free(scheduler)


# ---- prefix caching through the scheduler --------------------------------------------------

def test_a_later_request_skips_the_cached_prefix():
    scheduler, worker = make_scheduler(num_blocks=8), FakeWorker()
    prompt = fresh_tokens(9)
    scheduler.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(scheduler, worker)
    b = make_request("b", prompt + fresh_tokens(3))  # 12 tokens: 2 of a's blocks hit
    scheduler.add_request(b)
    out, _ = run_step(scheduler, worker)
    assert out.scheduled_new_reqs[0].block_ids == ([0, 1, 3],)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"b": 4}
    assert b.num_cached_tokens == 8
    assert scheduler.get_stats().prefix_cache_hit_rate == 8 / (9 + 12)
    run_to_completion(scheduler, worker)
    assert_all_blocks_free(scheduler)


def test_a_request_admitted_in_the_same_step_hits_blocks_computed_in_that_step():
    scheduler, worker = make_scheduler(num_blocks=8), FakeWorker()
    prompt = fresh_tokens(9)
    scheduler.add_request(make_request("c", prompt, max_tokens=2))
    scheduler.add_request(make_request("d", prompt, max_tokens=2))
    out, _ = run_step(scheduler, worker)
    assert out.num_scheduled_tokens == {"c": 9, "d": 1}
    assert [(n.block_ids[0], n.num_computed_tokens) for n in out.scheduled_new_reqs] == [([0, 1, 2], 0), ([0, 1, 3], 8)]
    run_to_completion(scheduler, worker)
    assert_all_blocks_free(scheduler)


def test_without_prefix_caching_nothing_is_skipped():
    scheduler, worker = make_scheduler(num_blocks=8, enable_caching=False), FakeWorker()
    prompt = fresh_tokens(9)
    scheduler.add_request(make_request("c", prompt, max_tokens=2))
    scheduler.add_request(make_request("d", prompt, max_tokens=2))
    out, _ = run_step(scheduler, worker)
    assert out.num_scheduled_tokens == {"c": 9, "d": 9}
    assert [n.block_ids[0] for n in out.scheduled_new_reqs] == [[0, 1, 2], [3, 4, 5]]
    run_to_completion(scheduler, worker)
    assert scheduler.get_stats().prefix_cache_hit_rate == 0.0
    assert_all_blocks_free(scheduler)


# ---- admission errors ------------------------------------------------------------------------

def test_add_request_rejects_what_can_never_run_and_the_others_still_run():
    scheduler, worker = make_scheduler(num_blocks=3, max_model_len=16), FakeWorker()
    with pytest.raises(ValueError, match=r"= 17 exceeds max_model_len \(16\)"):
        scheduler.add_request(make_request("too-long", 10, max_tokens=7))
    with pytest.raises(ValueError, match="needs 4 KV blocks but the cache has only 3"):
        scheduler.add_request(make_request("too-big", 10, max_tokens=6))
    with pytest.raises(ValueError, match="at least one token"):
        scheduler.add_request(make_request("empty", [], max_tokens=1))
    ok = make_request("ok", 8, max_tokens=4)  # 12 tokens: exactly the 3 blocks
    scheduler.add_request(ok)
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("ok", 2, max_tokens=1))
    assert list(scheduler.requests) == ["ok"]
    assert scheduler.waiting == [ok]

    run_to_completion(scheduler, worker)
    assert ok.output_token_ids == [1000, 1001, 1002, 1003]
    assert ok.status == RequestStatus.FINISHED_LENGTH
    assert_all_blocks_free(scheduler)


def test_prompt_plus_max_tokens_may_equal_max_model_len():
    scheduler, worker = make_scheduler(max_model_len=12), FakeWorker()
    with pytest.raises(ValueError, match=r"= 13 exceeds max_model_len \(12\)"):
        scheduler.add_request(make_request("over", 8, max_tokens=5))
    a = make_request("a", 8, max_tokens=4)
    scheduler.add_request(a)
    run_to_completion(scheduler, worker)
    assert a.output_token_ids == [1000, 1001, 1002, 1003]
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert_all_blocks_free(scheduler)


def test_a_request_whose_last_token_needs_no_slot_is_accepted():
    scheduler, worker = make_scheduler(num_blocks=1), FakeWorker()
    a = make_request("a", 4, max_tokens=1)  # computes 4 tokens in 1 block, samples 1, done
    scheduler.add_request(a)
    run_to_completion(scheduler, worker)
    assert a.output_token_ids == [1000]
    assert_all_blocks_free(scheduler)


# ---- stopping ------------------------------------------------------------------------------

def test_each_stop_condition_ends_its_request_with_its_reason():
    scripts = {
        "eos": [1000, EOS, 1002, 1003],
        "ignore-eos": [EOS, EOS, EOS, EOS],
        "stop-token": [1000, 1001, 7, 1003],
        "stop-token-ignore-eos": [7, 1001, 1002, 1003],
        "length": [1000, 1001, 1002, 1003],
    }
    scheduler = make_scheduler()
    worker = FakeWorker(sample=lambda rid, k: scripts[rid][k])
    requests = {
        "eos": make_request("eos", 5, max_tokens=4),
        "ignore-eos": make_request("ignore-eos", 5, max_tokens=3, ignore_eos=True),
        "stop-token": make_request("stop-token", 5, max_tokens=4, stop_token_ids=(7, 8)),
        "stop-token-ignore-eos": make_request("stop-token-ignore-eos", 5, max_tokens=4, stop_token_ids=(7,),
                                              ignore_eos=True),
        "length": make_request("length", 5, max_tokens=2),
    }
    for request in requests.values():
        scheduler.add_request(request)
    run_to_completion(scheduler, worker)

    got = {rid: (r.output_token_ids, r.status.finish_reason, r.stop_reason) for rid, r in requests.items()}
    assert got == {
        "eos": ([1000, EOS], "stop", None),
        "ignore-eos": ([EOS, EOS, EOS], "length", None),
        "stop-token": ([1000, 1001, 7], "stop", 7),
        "stop-token-ignore-eos": ([7], "stop", 7),
        "length": ([1000, 1001], "length", None),
    }
    assert_all_blocks_free(scheduler)


# ---- what the engine hears (EngineCoreOutputs) -------------------------------------------------

def logprobs_of(token_id: int) -> TokenLogprobs:
    return TokenLogprobs([token_id, 3], [-0.5, -1.5], 1)


def step_with_logprobs(scheduler: Scheduler, worker: FakeWorker) -> EngineCoreOutputs:
    """One step whose worker also reports each sampled token's logprobs and, for each prompt
    chunk, one entry per prompt token it covered (the scheduler passes both on untouched)."""
    out = scheduler.schedule()
    computed_before = {**{c.request_id: c.num_computed_tokens for c in out.scheduled_cached_reqs},
                       **{n.request_id: n.num_computed_tokens for n in out.scheduled_new_reqs}}
    runner_out = worker.execute(out)
    runner_out.logprobs = {rid: [logprobs_of(t) for t in ts] for rid, ts in runner_out.sampled_token_ids.items()}
    for rid, num_tokens in out.num_scheduled_tokens.items():
        start = computed_before[rid]
        covered = worker.token_ids[rid][start:min(start + num_tokens, worker.num_prompt_tokens[rid])]
        if covered:
            runner_out.prompt_logprobs[rid] = (start, [logprobs_of(t) for t in covered])
    core_outputs = scheduler.update_from_output(out, runner_out)
    scheduler.kv_cache_manager.check_integrity()
    return core_outputs


def test_engine_core_outputs_hold_exactly_each_steps_news():
    """A scripted schedule: a prefill chunk that samples nothing reports only its prompt logprobs;
    a sampled token comes with its logprobs; a prefix hit shows in num_cached_tokens; each
    finish reason (stop token, eos, length) comes with the token that caused it."""
    scripts = {"a": [1000, 7], "b": [1000, 1001], "c": [EOS]}
    scheduler = make_scheduler(max_num_batched_tokens=8)
    worker = FakeWorker(sample=lambda rid, k: scripts[rid][k])
    a = make_request("a", 6, max_tokens=3, stop_token_ids=(7,))
    scheduler.add_request(a)
    pa = a.prompt_token_ids

    assert step_with_logprobs(scheduler, worker).outputs == [
        EngineCoreOutput("a", [1000], new_logprobs=[logprobs_of(1000)],
                         new_prompt_logprobs=(0, [logprobs_of(t) for t in pa]), num_cached_tokens=0)]

    b = make_request("b", pa[:4] + fresh_tokens(5), max_tokens=2)  # a's first block: a prefix hit of 4
    c = make_request("c", 3, max_tokens=4)
    scheduler.add_request(b)
    scheduler.add_request(c)
    # a decodes (1 token), b computes its 5 uncached prompt tokens, c gets the 2 left of the budget.
    assert step_with_logprobs(scheduler, worker).outputs == [
        EngineCoreOutput("a", [7], "stop", 7, [logprobs_of(7)], None, 0),
        EngineCoreOutput("b", [1000], None, None, [logprobs_of(1000)],
                         (4, [logprobs_of(t) for t in b.prompt_token_ids[4:]]), 4),
        EngineCoreOutput("c", [], new_prompt_logprobs=(0, [logprobs_of(t) for t in c.prompt_token_ids[:2]]),
                         num_cached_tokens=0),
    ]
    assert step_with_logprobs(scheduler, worker).outputs == [
        EngineCoreOutput("b", [1001], "length", None, [logprobs_of(1001)], None, 4),
        EngineCoreOutput("c", [EOS], "stop", None, [logprobs_of(EOS)], (2, [logprobs_of(c.prompt_token_ids[2])]), 0),
    ]
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(scheduler)


def test_finish_requests_by_id_frees_them_and_skips_those_already_finished():
    scheduler, worker = make_scheduler(num_blocks=8), FakeWorker()
    a, b = make_request("a", 6, max_tokens=1), make_request("b", 5)
    scheduler.add_request(a)
    scheduler.add_request(b)
    _, core_outputs = run_step(scheduler, worker)
    assert [o.finish_reason for o in core_outputs.outputs] == ["length", None]  # a reached max_tokens

    scheduler.finish_requests(["a", "b", "never-added"], RequestStatus.FINISHED_STOPPED)
    assert (a.status, b.status) == (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(scheduler)
    out = scheduler.schedule()
    assert (out.finished_req_ids, out.is_empty) == ({"a", "b"}, True)


# ---- abort -----------------------------------------------------------------------------------

def test_abort_frees_a_running_request_and_tells_the_worker():
    scheduler, worker = make_scheduler(num_blocks=8), FakeWorker()
    a, b = make_request("a", 6), make_request("b", 5)
    scheduler.add_request(a)
    scheduler.add_request(b)
    run_step(scheduler, worker)
    assert scheduler.kv_cache_manager.pool.num_free_blocks == 4

    assert scheduler.abort_request("a") is a
    assert (a.status, a.status.finish_reason) == (RequestStatus.FINISHED_ABORTED, "abort")
    assert scheduler.running == [b]
    assert scheduler.kv_cache_manager.get_block_ids("a") == ([],)
    assert scheduler.kv_cache_manager.pool.num_free_blocks == 6
    scheduler.kv_cache_manager.check_integrity()
    assert scheduler.abort_request("a") is None
    assert scheduler.abort_request("never-added") is None

    out, _ = run_step(scheduler, worker)
    assert out.finished_req_ids == {"a"}
    assert out.num_scheduled_tokens == {"b": 1}
    run_to_completion(scheduler, worker)
    assert a.output_token_ids == [1000]
    assert b.output_token_ids == [1000, 1001, 1002, 1003]
    assert_all_blocks_free(scheduler)


def test_abort_of_a_waiting_or_preempted_request_removes_it_from_the_queue():
    scheduler, worker = make_scheduler(num_blocks=4, max_num_seqs=2), FakeWorker()
    a = make_request("a", 6, max_tokens=4)
    b = make_request("b", 7, max_tokens=4)
    c = make_request("c", 2, max_tokens=1)
    for request in (a, b, c):
        scheduler.add_request(request)
    run_step(scheduler, worker)
    assert scheduler.abort_request("c") is c  # never scheduled
    run_step(scheduler, worker)
    run_step(scheduler, worker)  # b preempts itself (see above)
    assert b.status == RequestStatus.PREEMPTED
    assert scheduler.abort_request("b") is b
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.waiting == []
    outs = run_to_completion(scheduler, worker)
    assert all(new_ids(out) == [] for out in outs)
    assert a.output_token_ids == [1000, 1001, 1002, 1003]
    assert_all_blocks_free(scheduler)


def test_a_request_aborted_while_its_step_runs_is_skipped_by_update_from_output():
    scheduler, worker = make_scheduler(num_blocks=8), FakeWorker()
    a, b = make_request("a", 6), make_request("b", 5)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    runner_out = worker.execute(out)
    scheduler.abort_request("a")
    updated = scheduler.update_from_output(out, runner_out)
    assert updated.outputs == [EngineCoreOutput("b", [1000])]
    assert a.output_token_ids == [] and a.status == RequestStatus.FINISHED_ABORTED
    assert b.output_token_ids == [1000]
    scheduler.kv_cache_manager.check_integrity()


# ---- everything together -------------------------------------------------------------------

def test_a_crowded_mix_of_requests_all_finish_and_free_every_block():
    """Shared prefixes, chunked prefills, priorities and preemptions under a small cache."""
    rng = random.Random(0)
    scheduler, worker = make_scheduler(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=16,
                                       max_model_len=64), FakeWorker()
    prefixes = [fresh_tokens(8), fresh_tokens(8), []]
    pending = []
    for i in range(24):
        prompt = rng.choice(prefixes) + fresh_tokens(rng.randint(1, 12))
        pending.append(make_request(f"r{i}", prompt, max_tokens=rng.randint(1, 40 - len(prompt)),
                                    priority=rng.randint(0, 2)))
    requests = list(pending)

    num_steps = 0
    heard: dict[str, list[EngineCoreOutput]] = {r.request_id: [] for r in requests}
    while pending or scheduler.has_unfinished_requests():
        for _ in range(min(len(pending), 3)):  # a few arrivals per step
            scheduler.add_request(pending.pop(0))
        out, core_outputs = run_step(scheduler, worker)
        for o in core_outputs.outputs:
            heard[o.request_id].append(o)
        assert not out.is_empty
        num_steps += 1
        assert num_steps < 1000

    # Recomputing a preempted request's tokens tells the engine nothing: each token once, one finish.
    for request in requests:
        outputs = heard[request.request_id]
        assert [t for o in outputs for t in o.new_token_ids] == request.output_token_ids
        assert [o.finish_reason for o in outputs] == [None] * (len(outputs) - 1) + ["length"]

    for request in requests:
        assert request.status == RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == [1000 + k for k in range(request.max_tokens)]
    assert scheduler.num_preemptions > 0
    assert scheduler.kv_cache_manager.prefix_stats.num_hit_tokens > 0
    assert_all_blocks_free(scheduler)


def test_a_draft_model_gets_lookahead_slots_within_what_admission_reserved():
    """A draft model writes its KV for the tokens it proposes from past the step's tokens: the
    scheduler allocates num_speculative_tokens slots more, but never past the prompt + max_tokens - 1
    slots admission counted (the last token is never fed), so a request that fits alone still does."""
    kv = KVCacheManager(16, BLOCK_SIZE, True, None, 64)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                             speculative_config={"model": "/draft", "num_speculative_tokens": 3})
    scheduler, worker = Scheduler(config, kv, 256), FakeWorker()
    scheduler.add_request(make_request("a", 6, max_tokens=8))  # 13 slots at most: 4 blocks
    held = []
    while scheduler.has_unfinished_requests():
        out, _ = run_step(scheduler, worker)
        if "a" in out.num_scheduled_tokens:
            request = scheduler.requests.get("a")
            held.append(len(worker.block_ids["a"][0]))
            if request is not None:
                end = request.num_computed_tokens  # the step's tokens end here
                assert held[-1] == cdiv(min(end + 3, 13), BLOCK_SIZE)
    assert held[0] == 3 and max(held) == 4  # 6 prompt tokens + 3 lookahead; never past 13 slots
    assert kv.pool.num_free_blocks == kv.num_usable_blocks


def test_lookahead_slots_are_for_full_attention_tables_only():
    groups = (KVCacheGroup((0,), None), KVCacheGroup((1,), 8))
    kv = KVCacheManager(32, BLOCK_SIZE, True, groups, 64)
    request = make_request("a", 6, max_tokens=20)
    new = kv.allocate_slots(request, 6, num_lookahead_tokens=5)
    assert [len(blocks) for blocks in new] == [cdiv(11, BLOCK_SIZE), cdiv(6, BLOCK_SIZE)]
