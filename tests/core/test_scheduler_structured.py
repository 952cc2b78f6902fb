"""The scheduler's side of structured outputs, with a fake grammar service (no xgrammar, no
torch): a constrained request (its grammar compiled before it came) gets a bitmask row only on
steps where it samples, advances its grammar on every token, stops where the grammar ends and
ends with an error, without the token, where the grammar cannot go on."""
from __future__ import annotations

import pytest

from dabba.config import SchedulerConfig
from dabba.core.kv_cache_manager import KVCacheManager
from dabba.core.outputs import ModelRunnerOutput
from dabba.core.request import Request
from dabba.core.scheduler import Scheduler
from dabba.sampling_params import SamplingParams


class FakeGrammars:
    """Each grammar ends after ``length`` accepted tokens; those in ``dead`` cannot go on."""

    def __init__(self, length: int = 3) -> None:
        self.dead: set[str] = set()
        self.accepted: dict[str, list[int]] = {}
        self.bitmask_calls: list[list[str]] = []
        self.freed: list[str] = []
        self.length = length

    def grammar_bitmask(self, request_ids: list[str]) -> list[str]:
        self.bitmask_calls.append(list(request_ids))
        return [f"mask:{r}" for r in request_ids]

    def accept_token(self, request_id: str, token_id: int) -> bool:
        if request_id in self.dead:
            raise ValueError("a dead end")
        self.accepted.setdefault(request_id, []).append(token_id)
        return len(self.accepted[request_id]) == self.length

    def free(self, request_id: str) -> None:
        self.freed.append(request_id)


def make(grammars: FakeGrammars, max_num_batched_tokens: int = 64) -> Scheduler:
    kv = KVCacheManager(64, 4, True, None, max_num_batched_tokens)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens), kv, 256, grammars)


def request(request_id: str, prompt_len: int, constrained: bool, max_tokens: int = 8, **kw) -> Request:
    params = SamplingParams(max_tokens=max_tokens, structured_outputs={"regex": "[a-z]+"} if constrained else None, **kw)
    return Request(request_id, list(range(100, 100 + prompt_len)), params, eos_token_ids=frozenset({2}), block_size=4)


def step(scheduler: Scheduler, token: int = 7):
    out = scheduler.schedule()
    sampled = {r: [token] for r, n in out.num_scheduled_tokens.items()
               if scheduler.requests[r].num_computed_tokens + n >= scheduler.requests[r].num_tokens}
    return out, scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))


def test_a_constrained_request_gets_rows_only_where_it_samples_and_stops_at_the_grammar_end() -> None:
    grammars = FakeGrammars(length=3)
    scheduler = make(grammars, max_num_batched_tokens=8)
    scheduler.add_request(request("p", 3, constrained=False, max_tokens=2))
    scheduler.add_request(request("c", 10, constrained=True))
    out, _ = step(scheduler)  # p's prompt; c's first chunk of 5 prompt tokens does not sample: no row
    assert out.num_scheduled_tokens == {"p": 3, "c": 5} and out.structured_output_request_ids == []
    out, core = step(scheduler)  # c's last 5 prompt tokens: it samples, so it gets a row
    assert out.num_scheduled_tokens == {"p": 1, "c": 5}
    assert out.structured_output_request_ids == ["c"] and out.grammar_bitmask == ["mask:c"]
    out, core = step(scheduler)
    assert out.structured_output_request_ids == ["c"] and not core.outputs[0].finished
    out, core = step(scheduler)  # the third accepted token ends the grammar: stopped, not length
    assert core.outputs[0].finish_reason == "stop" and grammars.accepted["c"] == [7, 7, 7]
    assert grammars.freed == ["c"] and not scheduler.has_unfinished_requests()


def test_the_grammar_end_outlasts_ignore_eos_and_min_tokens_but_length_comes_first() -> None:
    grammars = FakeGrammars(length=2)
    scheduler = make(grammars)
    scheduler.add_request(request("a", 4, constrained=True, ignore_eos=True, min_tokens=5))
    scheduler.add_request(request("b", 4, constrained=True, max_tokens=1))
    _, core = step(scheduler)
    assert {o.request_id: o.finish_reason for o in core.outputs} == {"a": None, "b": "length"}
    _, core = step(scheduler)
    assert [(o.request_id, o.finish_reason) for o in core.outputs] == [("a", "stop")]
    assert sorted(grammars.freed) == ["a", "b"]


def test_a_dead_end_ends_only_its_request_with_an_error_and_without_the_token() -> None:
    grammars = FakeGrammars()
    grammars.dead.add("bad")
    scheduler = make(grammars)
    scheduler.add_request(request("bad", 4, constrained=True))
    scheduler.add_request(request("ok", 4, constrained=False, max_tokens=1))
    out, core = step(scheduler)
    assert [(o.request_id, o.new_token_ids, o.finish_reason, o.error) for o in core.outputs] == [
        ("bad", [], "error", "a dead end"), ("ok", [7], "length", None)]
    assert not scheduler.has_unfinished_requests() and grammars.freed == ["bad"]


def test_without_a_grammar_service_constraints_are_refused() -> None:
    kv = KVCacheManager(64, 4, True, None, 64)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv, 256)
    with pytest.raises(ValueError, match="structured_outputs needs an engine"):
        scheduler.add_request(request("c", 4, constrained=True))
    assert not scheduler.has_unfinished_requests()
