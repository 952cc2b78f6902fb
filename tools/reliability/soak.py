"""Phase 1, soak: exact-checked completions and chat traffic from concurrent clients."""
from __future__ import annotations

import concurrent.futures
import random
from dataclasses import dataclass
from typing import Any

import httpx

from dabba.config import ServerConfig

from .common import (PhaseResult, Target, is_json, is_server_error, is_sse, sse_events, stream_error_events, timed,
                     wait_idle)


# ---- phase 1: soak -----------------------------------------------------------------------------------

PROMPTS = (
    "The quick brown fox",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):\n    ",
    "Caf\u00e9, na\u00efve, \u00fcber: \u2603 and \U0001f40d",
    "Explain, step by step and with examples, how a paged key-value cache lets a server batch "
    "many requests of different lengths without copying memory, and what happens when it runs out.",
)
STOP_SETS = (("e",), (" ", "."), ("\n",), ("th", "s", "a"))


@dataclass(frozen=True)
class SoakConfig:
    clients: int = 4
    requests_per_client: int = 6
    max_tokens: tuple[int, int] = (1, 24)  # drawn in this range per request
    seed: int = 0


@dataclass(frozen=True)
class SoakRequest:
    """One soak request; without stop strings its token count is exactly max_tokens x n."""

    endpoint: str  # "completions" or "chat"
    stream: bool
    n: int
    max_tokens: int
    prompt: str
    stop: tuple[str, ...] = ()
    temperature: float = 1.0
    seed: int | None = None

    @property
    def path(self) -> str:
        return "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"

    def label(self) -> str:
        return (f"{self.endpoint} stream={self.stream} n={self.n} max_tokens={self.max_tokens}"
                + (f" stop={list(self.stop)}" if self.stop else ""))

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "n": self.n, "ignore_eos": True,
                                "stream": self.stream, "temperature": self.temperature}
        if self.seed is not None:
            body["seed"] = self.seed
        if self.stop:
            body["stop"] = list(self.stop)
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.endpoint == "completions":  # logprobs: 0 -> one entry per token, to count them
            return {**body, "prompt": self.prompt, "logprobs": 0}
        return {**body, "messages": [{"role": "user", "content": self.prompt}], "logprobs": True, "top_logprobs": 0}


def soak_requests(rng: random.Random, count: int, limits: ServerConfig, max_tokens: tuple[int, int]
                  ) -> list[SoakRequest]:
    """A mix: both endpoints, streamed or not, n in {1, 2}, a third with stop strings."""
    requests = []
    for i in range(count):
        stop = rng.choice(STOP_SETS)[: limits.max_stop_sequences] if i % 3 == 2 else ()
        requests.append(SoakRequest(
            endpoint=("completions", "chat")[i % 2], stream=rng.random() < 0.5, n=min(rng.choice((1, 2)), limits.max_n),
            max_tokens=rng.randint(*max_tokens), prompt=rng.choice(PROMPTS), stop=stop,
            temperature=rng.choice((0.0, 0.7, 1.0)), seed=rng.choice((None, rng.randrange(2**31)))))
    return requests


@dataclass
class ChoiceSeen:
    """What the client received for one choice: tokens counted from logprobs, text, finish."""

    tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    stop_reason: Any = None
    finishes: int = 0


def read_completion_choice(c: dict, seen: dict[int, ChoiceSeen], problems: list[str]) -> None:
    s = seen.setdefault(c["index"], ChoiceSeen())
    s.text += c["text"]
    if c.get("logprobs") is None:
        problems.append(f"choice {c['index']}: no logprobs (asked for logprobs: 0)")
    else:
        s.tokens += len(c["logprobs"]["tokens"])
    note_finish(s, c)


def read_chat_choice(c: dict, seen: dict[int, ChoiceSeen], problems: list[str], streamed: bool) -> None:
    s = seen.setdefault(c["index"], ChoiceSeen())
    s.text += (c["delta"] if streamed else c["message"]).get("content") or ""
    if c.get("logprobs") is not None:
        s.tokens += len(c["logprobs"]["content"])
    elif not streamed:  # a stream's first chunk (the role) carries none
        problems.append(f"choice {c['index']}: no logprobs (asked for logprobs: true)")
    note_finish(s, c)


def note_finish(s: ChoiceSeen, c: dict) -> None:
    if c.get("finish_reason") is not None:
        s.finishes += 1
        s.finish_reason, s.stop_reason = c["finish_reason"], c.get("stop_reason")


def check_choices(spec: SoakRequest, seen: dict[int, ChoiceSeen], usage: Any) -> list[str]:
    """Exact checks of what arrived against what was asked."""
    problems = []
    if sorted(seen) != list(range(spec.n)):
        problems.append(f"choice indexes {sorted(seen)}, expected 0..{spec.n - 1}")
    for i, s in sorted(seen.items()):
        if s.finishes != 1:
            problems.append(f"choice {i}: {s.finishes} finish reasons")
        if not spec.stop:
            if s.finish_reason != "length" or s.tokens != spec.max_tokens:
                problems.append(f"choice {i}: finish_reason={s.finish_reason!r} after {s.tokens} tokens, expected "
                                f"'length' after {spec.max_tokens} (ignore_eos)")
        else:
            if s.finish_reason == "length" and s.tokens != spec.max_tokens:
                problems.append(f"choice {i}: 'length' after {s.tokens} tokens, max_tokens {spec.max_tokens}")
            elif s.finish_reason == "stop" and (s.stop_reason not in spec.stop or s.tokens > spec.max_tokens):
                problems.append(f"choice {i}: 'stop' with stop_reason {s.stop_reason!r} after {s.tokens} tokens")
            elif s.finish_reason not in ("length", "stop"):
                problems.append(f"choice {i}: finish_reason {s.finish_reason!r}")
            found = [stop for stop in spec.stop if stop in s.text]
            if found:
                problems.append(f"choice {i}: the text holds stop strings {found}: {s.text[:80]!r}")
    if not isinstance(usage, dict):
        return problems + [f"usage is {usage!r}"]
    counted = sum(s.tokens for s in seen.values())
    if usage.get("completion_tokens") != counted:
        problems.append(f"usage.completion_tokens={usage.get('completion_tokens')} but {counted} tokens arrived")
    if not spec.stop and usage.get("completion_tokens") != spec.max_tokens * spec.n:
        problems.append(f"usage.completion_tokens={usage.get('completion_tokens')}, expected "
                        f"max_tokens x n = {spec.max_tokens * spec.n}")
    if not usage.get("prompt_tokens") or usage.get("total_tokens") != usage["prompt_tokens"] + counted:
        problems.append(f"usage {usage} does not add up")
    return problems


def read_choice(spec: SoakRequest, c: dict, seen: dict[int, ChoiceSeen], problems: list[str]) -> None:
    if spec.endpoint == "chat":
        read_chat_choice(c, seen, problems, spec.stream)
    else:
        read_completion_choice(c, seen, problems)


def soak_response_problems(spec: SoakRequest, r: httpx.Response) -> tuple[list[str], dict[int, ChoiceSeen]]:
    """Everything wrong with one soak response, and what arrived per choice."""
    seen: dict[int, ChoiceSeen] = {}
    if r.status_code != 200:
        return [f"HTTP {r.status_code}: {r.text[:200]!r}"], seen
    problems: list[str] = []
    if not spec.stream:
        if not is_json(r):
            return [f"content-type {r.headers.get('content-type')!r}, expected JSON"], seen
        body = r.json()
        for c in body["choices"]:
            read_choice(spec, c, seen, problems)
        return problems + check_choices(spec, seen, body.get("usage")), seen
    if not is_sse(r):
        return [f"content-type {r.headers.get('content-type')!r}, expected text/event-stream"], seen
    events, problems = sse_events(r.text)
    errors = stream_error_events(events)
    if errors:
        return problems + [f"error events in the stream: {errors[:2]}"], seen
    if not events or events[-1].get("choices") != [] or events[-1].get("usage") is None:
        problems.append("the last event is not the usage chunk (choices [] and usage)")
    if any(e.get("usage") is not None for e in events[:-1]):
        problems.append("usage in an event before the last")
    for event in events:
        for c in event.get("choices", []):
            read_choice(spec, c, seen, problems)
    return problems + check_choices(spec, seen, events[-1].get("usage") if events else None), seen


def soak_client(target: Target, name: str, specs: list[SoakRequest]) -> PhaseResult:
    """One client: its requests in sequence on one connection."""
    result = PhaseResult("soak")
    with target.client() as client:
        for k, spec in enumerate(specs):
            result.add("requests")
            result.add("streamed" if spec.stream else "single")
            result.add("with_stop" if spec.stop else "ignore_eos_exact")
            try:
                r = client.post(spec.path, json=spec.body(target.model))
                result.server_errors += is_server_error(r)
                problems, seen = soak_response_problems(spec, r)
            except (httpx.HTTPError, KeyError, TypeError, ValueError, AttributeError) as e:
                problems, seen = [f"{type(e).__name__}: {e}"], {}
            if problems:
                result.failures += [f"{name} request {k} ({spec.label()}): {p}" for p in problems]
            else:
                result.add("checked")
                result.add("tokens", sum(s.tokens for s in seen.values()))
                result.add("stopped_by_a_stop_string", sum(s.finish_reason == "stop" for s in seen.values()))
    return result


@timed
def run_soak(target: Target, config: SoakConfig = SoakConfig()) -> PhaseResult:
    """C concurrent clients, each sending its own mix of requests; every response checked exactly.
    Ends with the server settled (nothing left running)."""
    rng = random.Random(config.seed)
    plans = [soak_requests(rng, config.requests_per_client, target.limits, config.max_tokens)
             for _ in range(config.clients)]
    result = PhaseResult("soak", {"clients": config.clients, "requests": 0, "checked": 0})
    with concurrent.futures.ThreadPoolExecutor(config.clients) as pool:
        for part in pool.map(lambda i: soak_client(target, f"client {i}", plans[i]), range(config.clients)):
            result.merge(part)
    problem = wait_idle(target)
    if problem:
        result.failures.append(f"after the soak: {problem}")
    return result
