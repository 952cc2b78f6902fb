"""Speculative decoding as the scheduler sees it: one policy object (make_speculation), asked at
three points of a step, so that the scheduler names no draft itself:

1. scheduling a request: which of its drafts to verify with its next token (``drafts``) and how
   many KV slots past the step a proposer writes (``lookahead``);
2. the batch scheduled: how many tokens each request may propose for its next step
   (``budget_drafts``: adaptive drafts, core/spec_budget.py);
3. the step's outputs: what each request's drafts gave (``verified``), and what the step cost
   (``record_step``, from the engine's measurement).

The drafts live on the Request (``spec_token_ids``, never in ``all_token_ids``): proposed by the
worker last step, scheduled after the next token and verified in the same forward; the scheduler
counts only the accepted ones computed. No torch (core/)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from dabba.config import SpeculativeConfig
from dabba.core.outputs import ModelRunnerOutput, SchedulerOutput
from dabba.core.request import Request
from dabba.core.spec_budget import (EXPLORE_EVERY, RowBlocks, StepCost, draft_budgets, engine_acceptance,
                                     lookahead_slots, request_acceptance)


@dataclass
class SpecCounters:
    """Speculative decoding's totals since the engine started (SchedulerStats, /metrics)."""

    num_drafts: int = 0  # verified steps of a request with drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rejections: int = 0  # verified steps in which a draft was rejected


class Speculation(Protocol):
    counters: SpecCounters

    def drafts(self, request: Request, num_new: int, budget: int) -> list[int]: ...

    def lookahead(self, request: Request, end: int) -> int: ...

    def budget_drafts(self, out: SchedulerOutput, requests: dict[str, Request]) -> None: ...

    def verified(self, request: Request, num_drafts: int, num_rejected: int) -> None: ...

    def record_step(self, out: SchedulerOutput, runner_out: ModelRunnerOutput, seconds: float) -> None: ...


class NoSpeculation:
    """No proposer: nothing to verify, no slots past the step, nothing to budget."""

    def __init__(self) -> None:
        self.counters = SpecCounters()

    def drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        return []

    def lookahead(self, request: Request, end: int) -> int:
        return 0

    def budget_drafts(self, out: SchedulerOutput, requests: dict[str, Request]) -> None:
        pass

    def verified(self, request: Request, num_drafts: int, num_rejected: int) -> None:
        pass

    def record_step(self, out: SchedulerOutput, runner_out: ModelRunnerOutput, seconds: float) -> None:
        pass


class DraftSpeculation:
    """Drafts from an n-gram lookup or a draft model (the worker's proposer), up to
    ``num_speculative_tokens`` each, or as many as make a step's tokens per second highest
    (``adaptive_drafts``), priced by the worker's kernel row blocks (``row_blocks``: data the worker
    reports once) and by the engine's own measured steps."""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int, row_blocks: RowBlocks) -> None:
        self.spec = spec
        self.max_model_len = max_model_len
        self.counters = SpecCounters()
        self.step_cost = StepCost(row_blocks)  # a decode step's time by its rows (adaptive drafts)
        self._last_step_decoded = False  # whether the last step had no prefill tokens (StepCost)
        self.num_steps = 0  # steps scheduled with adaptive drafts (one in EXPLORE_EVERY lets every request try one)

    def drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The draft tokens to verify with a decoding request's next token: as many as the budget,
        max_tokens and max_model_len leave room to accept (admission reserved KV for those)."""
        if not request.spec_token_ids or num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return []
        room = min(budget - 1, request.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - request.num_tokens - 1)
        return request.spec_token_ids[:max(room, 0)]

    def lookahead(self, request: Request, end: int) -> int:
        return lookahead_slots(self.spec.num_lookahead_tokens, request, end, self.max_model_len)

    def budget_drafts(self, out: SchedulerOutput, requests: dict[str, Request]) -> None:
        """With adaptive drafts, how many tokens each request may propose for its next step: the
        count over the batch that makes a step's tokens per second highest (core/spec_budget.py)."""
        if not self.spec.adaptive_drafts:
            return
        c = self.counters
        engine = engine_acceptance(c.num_accepted_tokens, c.num_rejections)
        acceptance = {rid: request_acceptance(requests[rid].spec_accepted, requests[rid].spec_rejected, engine)
                      for rid in out.num_scheduled_tokens}
        base_rows = out.total_num_scheduled_tokens - sum(len(d) for d in out.scheduled_spec_decode_tokens.values())
        out.spec_token_budget = draft_budgets(self.step_cost, base_rows, acceptance, self.spec.num_speculative_tokens)
        self.num_steps += 1
        if self.num_steps % EXPLORE_EVERY == 0:  # a draft to learn from, and a size to measure
            out.spec_token_budget = {rid: max(budget, 1) for rid, budget in out.spec_token_budget.items()}
        elif self.num_steps % EXPLORE_EVERY == EXPLORE_EVERY // 2 and not self.step_cost.measured(base_rows):
            out.spec_token_budget = dict.fromkeys(out.spec_token_budget, 0)  # the size without drafts, to measure

    def verified(self, request: Request, num_drafts: int, num_rejected: int) -> None:
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_drafts
        c.num_accepted_tokens += num_drafts - num_rejected
        c.num_rejections += num_rejected > 0
        request.spec_accepted += num_drafts - num_rejected
        request.spec_rejected += num_rejected > 0

    def record_step(self, out: SchedulerOutput, runner_out: ModelRunnerOutput, seconds: float) -> None:
        """The time a step took, from schedule() to its outputs (the engine measures it): the
        proposer's share prices the next step's drafts, the rest this step's rows (decode steps
        only: core/spec_budget.StepCost). Nothing to do without adaptive drafts."""
        if not self.spec.adaptive_drafts:
            return
        self.step_cost.record_drafting(runner_out.draft_passes, runner_out.draft_seconds)
        decode = all(n == 1 or rid in out.scheduled_spec_decode_tokens for rid, n in out.num_scheduled_tokens.items())
        if not out.is_empty and decode and self._last_step_decoded:  # not on caches a prefill just swept
            self.step_cost.record(out.total_num_scheduled_tokens, seconds - runner_out.draft_seconds)
        self._last_step_decoded = decode


def make_speculation(spec: SpeculativeConfig | None, max_model_len: int, row_blocks: RowBlocks) -> Speculation:
    return NoSpeculation() if spec is None else DraftSpeculation(spec, max_model_len, row_blocks)
