"""How one request wants its tokens chosen and when it stops (the fields vLLM and the OpenAI API
use, with the same meanings)."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from dabba.errors import InvalidRequest
from dabba.structured_output.params import StructuredOutputsParams, ThinkingSpan


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request carries (vLLM's values)."""

    CUMULATIVE = 0  # every step: everything so far
    DELTA = 1  # every step: only what is new (the prompt and its logprobs in the first output only)
    FINAL_ONLY = 2  # once, when every sample finished: everything


def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise InvalidRequest(name, f"{name} must be {allowed}, got {value!r}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    """A finite int or float: NaN and infinities pass no range check meaningfully."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


MAX_TEMPERATURE = 100.0  # past this every distribution is flat to float32's precision
MAX_REPETITION_PENALTY = 10.0
MAX_TOP_K = 2**31 - 1  # larger than any vocabulary (a top_k past the vocabulary keeps every token)
SEED_RANGE = (-(2**63), 2**64)  # what a 64-bit generator seed can hold, signed or not


@dataclass
class SamplingParams:
    """Per-request generation settings; an invalid value raises InvalidRequest (a ValueError)
    naming the field and its allowed range.

    Processing order each step (as in vLLM): logprobs are taken from the model's raw logits;
    then logit_bias, the min_tokens ban on stop tokens, repetition/frequency/presence
    penalties; then temperature (0 = greedy), top_k, top_p, min_p (in transformers' order);
    then sampling. With a ``seed``, the k-th sampled token depends only on (seed, k, logits),
    so the result does not depend on what else is batched.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1  # -1: all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top-N logprobs per generated token (plus the sampled token's)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (plus the prompt token's)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Output constrained to a JSON schema, regex, choice or grammar (a dict of the same fields is
    # taken too). Its mask applies before everything above, logprobs included; the grammar's end
    # stops the request, and before min_tokens it is the grammar that says whether eos may come.
    structured_outputs: StructuredOutputsParams | None = None
    # A reasoning model's thinking (the server sets it from its reasoning parser): a constraint
    # holds only the answer after it, and a budget bounds it (structured_output/params.py).
    thinking: ThinkingSpan | None = None

    def __post_init__(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        _check(_is_number(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
               f"a number in [0, {MAX_TEMPERATURE:g}]", self.temperature)
        _check(_is_int(self.top_k) and (self.top_k == -1 or 1 <= self.top_k <= MAX_TOP_K), "top_k",
               f"-1 (disabled) or an integer in [1, {MAX_TOP_K}]", self.top_k)
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, "in [-2, 2]", value)
        _check(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
               "repetition_penalty", f"in (0, {MAX_REPETITION_PENALTY:g}]", self.repetition_penalty)
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias", "a dict of token id -> bias", self.logit_bias)
            for token_id, bias in self.logit_bias.items():
                _check(_is_int(token_id) and token_id >= 0, "logit_bias", "keyed by token ids >= 0", token_id)
                _check(_is_number(bias) and -100 <= bias <= 100, "logit_bias", "biases in [-100, 100]", bias)
        _check(self.seed is None or (_is_int(self.seed) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1] - self.n),
               "seed", "None or an integer in [-2**63, 2**64 - n)", self.seed)
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
               "an integer >= 1 or None", self.max_tokens)
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings", self.stop)
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "a list of token ids >= 0", self.stop_token_ids)
        self.stop_token_ids = list(self.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and 0 <= value <= 20), name, "None or an integer in [0, 20]", value)
        _check(isinstance(self.output_kind, RequestOutputKind), "output_kind", "a RequestOutputKind", self.output_kind)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        _check(self.thinking is None or isinstance(self.thinking, ThinkingSpan), "thinking", "None or a ThinkingSpan",
               self.thinking)

    @property
    def masked(self) -> bool:
        """Whether each sampled token goes through a mask the structured-output manager keeps: a
        constraint's, or a thinking budget's (which allows only the closing tag once spent)."""
        return self.structured_outputs is not None or (self.thinking is not None and self.thinking.budget is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids are only checkable once the model is known."""
        bad = [t for t in (self.logit_bias or {}) if t >= vocab_size]
        _check(not bad, "logit_bias", f"keyed by token ids in [0, {vocab_size})", bad)
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        _check(not bad, "stop_token_ids", f"token ids in [0, {vocab_size})", bad)
