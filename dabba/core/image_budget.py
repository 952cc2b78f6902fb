"""How much of a step image requests take while other requests decode: image encoding (units of
models/encoder_steps.py, priced by their operations) and then tokens of their prompts, as much as
keep the step within ``slowdown`` times the decodes' own step, so that an arriving image slows
chat streams by that much at most instead of stalling them for its whole encoding and prefill.
The image waits longer for its first token instead.

The costs are recent means: a decode step's time from the steps that ran decodes alone; an
operation of encoding's from the worker's own timing of the units it ran (ModelRunnerOutput's
encoder_seconds over encoder_work); an image request's prompt token's from the steps that carried
such tokens beside decodes (their time past the decode step's and the encoding's, per token).
While image work waits, the first step with decodes runs them alone, the next takes one unit (or
FIRST_TOKENS tokens), then the costs rule; one step in REFRESH_EVERY runs the decodes alone, so
their time keeps up with growing contexts. While other prompts keep every step from being a
decode-only one, image work waits REFRESH_EVERY steps, then runs the first share unpriced. Prompt
tokens a step grants and the image requests do not take add up (``credit``): an image whose
tokens must run in one chunk (Gemma 3's) runs once enough has been granted, its cost spread over
the steps that saved it. Pure bookkeeping, no torch (core/)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from dabba.core.pooling_budget import FIRST_TOKENS, REFRESH_EVERY, _mean
from dabba.core.request import Request

MAX_CREDIT = 1 << 16
PROBE = 1.0  # operations granted while their price is unknown: one unit runs


@dataclass
class ImageBudget:
    slowdown: float  # a step with image work takes at most this times a decode-only step
    decode_seconds: float | None = None
    work_seconds: float | None = None  # an operation of encoding's
    token_seconds: float | None = None
    mixed_run: int = 0  # steps with image work since the last decode-only one
    unpriced: int = 0  # steps waited for a decode-only step to time
    credit: int = 0  # prompt tokens granted and not yet taken (an image that must run whole waits for enough)
    active: bool = False  # image work waited beside decodes in the last step

    def allowance(self, encoding: bool) -> tuple[float, int]:
        """(operations of encoding, image prompt tokens) the next step may take beside decodes
        (SchedulerOutput.encoder_work: one unit at least where above 0); ``encoding``: encodings
        wait (they take the step's share before prompt tokens do)."""
        if self.decode_seconds is None and self.unpriced < REFRESH_EVERY or self.mixed_run >= REFRESH_EVERY:
            self.unpriced += self.decode_seconds is None
            return 0, 0  # the decodes alone (while other prompts keep them from being timed, not for long)
        spare = (self.slowdown - 1.0) * (self.decode_seconds or 0.0)
        if encoding:
            return (PROBE if not self.work_seconds else max(spare / self.work_seconds, PROBE)), 0
        tokens = FIRST_TOKENS if not self.token_seconds else max(1, int(spare / self.token_seconds + 1e-6))
        self.credit = min(self.credit + tokens, MAX_CREDIT)
        return 0, self.credit

    def begin(self, active: bool) -> None:
        """Image work waits beside decodes this step (``active``); after a time without, the
        decodes' time is measured afresh."""
        if active and not self.active:
            self.decode_seconds, self.mixed_run, self.unpriced, self.credit = None, 0, 0, 0
        self.active = active

    def record(self, decode_rows: int, image_tokens: int, other_tokens: int, units: int, operations: float,
               encoder_seconds: float, seconds: float) -> None:
        """A step's time and what it ran: rows of decoding requests, prompt tokens of image
        requests and of others, and units of encoding (their operations and time)."""
        if units and operations > 0:
            self.work_seconds = max(_mean(self.work_seconds, encoder_seconds / operations), 1e-18)
        self.credit = max(self.credit - image_tokens, 0)
        if not self.active or decode_rows == 0:
            return
        if not units and not image_tokens:
            self.mixed_run = 0
            if not other_tokens:  # the decodes alone: their time
                self.decode_seconds = _mean(self.decode_seconds, seconds)
            return
        self.mixed_run += 1
        if image_tokens and not other_tokens and self.decode_seconds is not None:
            per_token = max(seconds - self.decode_seconds - encoder_seconds, 0.0) / image_tokens
            self.token_seconds = max(_mean(self.token_seconds, per_token), 1e-9)


def image_prefill(request: Request) -> bool:
    """A generation request with images whose prompt is not computed yet."""
    return bool(request.mm_features) and request.pooling_params is None and \
        request.num_computed_tokens < request.num_prompt_tokens


def generating(request: Request) -> bool:
    """A generation request past its prompt: it decodes."""
    return request.pooling_params is None and request.num_computed_tokens >= request.num_prompt_tokens


def image_work_waits(running: list[Request], waiting: list[Request]) -> tuple[bool, bool]:
    """(a generation request decodes, an image request's prompt waits)."""
    decodes = any(generating(r) for r in running)
    return decodes, any(image_prefill(r) for r in running) or any(image_prefill(r) for r in waiting)


def image_step_mix(num_scheduled_tokens: Mapping[str, int], requests: Mapping[str, Request]) -> tuple[int, int, int]:
    """A step's rows of decoding requests, prompt tokens of image requests and of others."""
    decode = image = other = 0
    for request_id, num_new in num_scheduled_tokens.items():
        request = requests[request_id]
        if image_prefill(request):
            image += num_new
        elif generating(request):
            decode += num_new
        else:
            other += num_new
    return decode, image, other
