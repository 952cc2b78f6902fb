"""How many of its drafts a request verifies in a step: those expected to pay for the time they add.

A draft token lengthens everyone's step by the time one more token costs in the forward, b. In
that time the batch would have produced b * G tokens without it, G being its plain rate, R / (a +
b R) for R requests in a step that takes a + b * tokens. The j-th draft of a request is accepted
with probability alpha^j (alpha: its per-draft acceptance, and every draft before it must be
accepted too), so it is worth verifying while alpha^j > b R / (a + b R).

On a memory-bound step (a big model, few requests) b is small against a: every draft is worth it.
On a compute-bound one (a small model, many requests) only well-accepted drafts are. a and b come
from the steps themselves, fitted by least squares with older steps weighing less; alpha from the
request's own drafts, starting from the engine's. A request whose drafts are not worth it still
verifies one every EXPLORE_EVERY steps, so that its estimate can recover when its text turns
predictable. Pure bookkeeping, no torch (core/).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dabba.core.request import Request

DECAY = 0.98  # weight of a step in the fit, per step since
PRIOR_DRAFTS = 4  # a request's acceptance starts as the engine's, worth this many verified drafts
EXPLORE_EVERY = 16  # steps between the single drafts of a request whose drafts are not worth it


@dataclass
class StepCost:
    """A step's time as a + b * tokens, by exponentially weighted least squares."""

    w: float = 0.0  # sum of weights
    n: float = 0.0  # weighted sums of tokens, tokens^2, seconds, tokens * seconds
    nn: float = 0.0
    t: float = 0.0
    nt: float = 0.0

    def record(self, num_tokens: int, seconds: float) -> None:
        self.w, self.n, self.nn, self.t, self.nt = (DECAY * self.w + 1, DECAY * self.n + num_tokens,
                                                    DECAY * self.nn + num_tokens ** 2, DECAY * self.t + seconds,
                                                    DECAY * self.nt + num_tokens * seconds)

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None until steps of different sizes have been seen."""
        spread = self.w * self.nn - self.n ** 2
        if self.w < 2 or spread <= 1e-9 * max(self.w * self.nn, 1.0):
            return None
        b = max((self.w * self.nt - self.n * self.t) / spread, 0.0)
        a = max((self.t - b * self.n) / self.w, 0.0)
        return a, b

    def draft_threshold(self, num_requests: int) -> float:
        """The acceptance probability a draft token needs to be worth verifying: b R / (a + b R)."""
        fitted = self.fit()
        if fitted is None:
            return 0.0
        a, b = fitted
        cost = b * num_requests
        return cost / (a + cost) if a + cost > 0 else 0.0


def worth_verifying(num_drafts: int, acceptance: float, threshold: float) -> int:
    """The most drafts j (of num_drafts) with acceptance^j > threshold."""
    if threshold <= 0.0:
        return num_drafts
    if acceptance <= threshold:
        return 0
    if acceptance >= 1.0:
        return num_drafts
    return min(num_drafts, math.ceil(math.log(threshold) / math.log(acceptance)) - 1)


def engine_acceptance(accepted: int, rejected: int) -> float:
    """Per-draft acceptance over every request, as if one more draft had been accepted (1 before
    any draft: worth a try; never 0 after the first rejection)."""
    return (accepted + 1) / (accepted + rejected + 1)


def request_acceptance(accepted: int, rejected: int, engine_acceptance: float) -> float:
    """Per-draft acceptance of one request: drafts accepted over those verified (a step's drafts
    after its first rejection were never verified), starting from the engine's."""
    return (accepted + PRIOR_DRAFTS * engine_acceptance) / (accepted + rejected + PRIOR_DRAFTS)


def lookahead_slots(num_lookahead_tokens: int, request: Request, end: int, max_model_len: int) -> int:
    """KV slots past a step's tokens (which end at position ``end``) that the proposer writes (a
    draft model's own KV for the tokens it proposes from), within the prompt + max_tokens - 1 slots
    admission reserved (the last token is never fed), so a request that fits alone still does."""
    slots = min(request.num_prompt_tokens + request.max_tokens, max_model_len) - 1
    return max(0, min(num_lookahead_tokens, slots - end))
