"""How many tokens of pooling requests (embeddings, scores) a step takes while generation requests
decode: as many as keep the step within ``slowdown`` times the decodes' own step, so that a burst
of embeddings slows chat streams by that much at most instead of stalling them for the length of
its prefills. Decode steps are memory-bound: the weights a step reads anyway serve a few more
rows almost for free, and this is the share of them.

Both costs come from the engine's own steps (a recent mean of each): a decode step's time from
the steps that ran decodes alone, a pooling token's from those that carried pooling tokens too
(their time past the decode step's, per token). The first step with decodes runs them alone, the
next takes FIRST_TOKENS (until a token's cost is known), then the costs rule; one step in
REFRESH_EVERY of a run of mixed steps runs the decodes alone, so that their time keeps up with
growing contexts and changing batches. Steps are timed only while pooling requests exist (the
scheduler's hot path stays as it was without them): when the first arrives after none, the
decodes' time is measured afresh (restart). Steps with other prefills (a
generation request's prompt) teach nothing: their extra time is not the pooling tokens'. Pure
bookkeeping, no torch (core/)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from dabba.core.request import Request

MEAN = 0.2  # weight of a step in its recent mean
FIRST_TOKENS = 16  # pooling tokens a step takes before the costs are known
REFRESH_EVERY = 16  # mixed steps between two that run the decodes alone


@dataclass
class PoolingBudget:
    slowdown: float  # a step with pooling tokens takes at most this times a decode-only step
    decode_seconds: float | None = None
    token_seconds: float | None = None
    mixed_run: int = 0  # mixed steps since the last decode-only one

    def tokens(self) -> int:
        """Pooling tokens the next step may take while requests decode (0: none this step)."""
        if self.decode_seconds is None or self.mixed_run >= REFRESH_EVERY:
            return 0
        if self.token_seconds is None:
            return FIRST_TOKENS
        return max(1, int((self.slowdown - 1.0) * self.decode_seconds / self.token_seconds + 1e-6))

    def restart(self) -> None:
        """Pooling requests arrive after a time without: the decodes' time may have changed since."""
        self.decode_seconds, self.mixed_run = None, 0

    def record(self, decode_rows: int, pooling_tokens: int, prefill_tokens: int, seconds: float) -> None:
        """A step's time and what it ran: rows of decoding generation requests, tokens of pooling
        requests, and tokens of generation prompts."""
        if decode_rows == 0 or prefill_tokens:
            return
        if pooling_tokens == 0:
            self.decode_seconds = _mean(self.decode_seconds, seconds)
            self.mixed_run = 0
            return
        self.mixed_run += 1
        if self.decode_seconds is not None:
            per_token = max(seconds - self.decode_seconds, 0.0) / pooling_tokens
            self.token_seconds = max(_mean(self.token_seconds, per_token), 1e-9)


def _mean(old: float | None, new: float) -> float:
    return new if old is None else MEAN * new + (1.0 - MEAN) * old


def decoding(request: Request) -> bool:
    """Whether a (not yet updated) request's step feeds its one last token: it decodes."""
    return request.num_tokens - request.num_computed_tokens == 1


def step_mix(num_scheduled_tokens: Mapping[str, int], requests: Mapping[str, Request]) -> tuple[int, int, int]:
    """A step's rows of decoding generation requests, pooling tokens, and prompt tokens
    (PoolingBudget.record's)."""
    decode = pooling = prompt = 0
    for request_id, num_new in num_scheduled_tokens.items():
        request = requests[request_id]
        if request.pooling_params is not None:
            pooling += num_new
        elif decoding(request):
            decode += num_new
        else:
            prompt += num_new
    return decode, pooling, prompt
