"""The server's reliability suite: exact-checked traffic, clients that hang up, fuzzing from the
OpenAPI schema and a table of malformed requests, against `dabba serve`.

    python -m tools.reliability [--url URL] [--model DIR] [--minutes M] [--clients C] [--json-out FILE]

Without --url the script starts the server itself (MODEL: the bundled demo model by default),
with an API key and tight bounds, and stops it with SIGTERM at the end, checking it exits 0 (a
clean drain). Phases (each a function returning a PhaseResult; tests/reliability calls them
against an in-process server with small counts):

1. soak: C clients send completions and chat requests, streamed or not, n in {1, 2}, with
   ignore_eos (so the token count is known) and some with stop strings; every response is
   checked exactly (tokens counted from logprobs against usage and max_tokens x n).
2. storm: clients hang up at random points; the server must then settle (no request running or
   waiting, no KV block held) and give the same greedy outputs as before.
3. fuzz: schemathesis cases from /openapi.json, valid and invalid: never a 5xx, every 4xx in
   OpenAI's error shape, every 2xx JSON (or a stream ending in [DONE]).
4. malformed: hand-written bad requests, each with its expected status and param, each followed
   by a good request on the same client.

Phases 1-3 repeat in rounds until --minutes pass (at least one round), then phase 4 runs. The
report (one JSON object on stdout) has every phase's counts and failures and the totals; for a
server the script started, its RSS (at start, after each round, at the end), its exit status and
the error lines of its log (any is a failure: a traceback is a bug even if every answer was
right). Exit status 1 if anything failed.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import random
import secrets
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx

from dabba.config import DEMO_MODEL, ServerConfig

REPO = Path(__file__).resolve().parents[1]

# ---- the server under test ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A running server and the bounds it is expected to enforce (its ServerConfig)."""

    url: str
    model: str  # the served model name
    api_key: str | None = None
    limits: ServerConfig = field(default_factory=ServerConfig)
    timeout_s: float = 120.0  # per request: bounds a hang only

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, auth: bool = True) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.auth() if auth else {}, timeout=self.timeout_s)


@dataclass
class PhaseResult:
    """What one phase did (``counts``) and what it found wrong (``failures``)."""

    phase: str
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    server_errors: int = 0  # 5xx responses, and stream error events of type server_error
    seconds: float = 0.0
    breakdown: dict[str, dict[str, int]] = field(default_factory=dict)  # counts per operation (fuzz)

    def add(self, key: str, k: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + k

    def add_to(self, group: str, key: str) -> None:
        counts = self.breakdown.setdefault(group, {})
        counts[key] = counts.get(key, 0) + 1

    def merge(self, other: "PhaseResult") -> None:
        for key, k in other.counts.items():
            self.add(key, k)
        self.failures += other.failures
        self.server_errors += other.server_errors

    def to_dict(self, max_failures: int = 50) -> dict[str, Any]:
        return {"phase": self.phase, **self.counts, "server_errors": self.server_errors,
                "seconds": round(self.seconds, 2), **({"by_operation": self.breakdown} if self.breakdown else {}),
                "num_failures": len(self.failures), "failures": self.failures[:max_failures]}


def timed(run: Callable[..., PhaseResult]) -> Callable[..., PhaseResult]:
    """Records the phase's wall time in its result (reported only; nothing depends on it)."""
    @functools.wraps(run)
    def wrapper(*args: Any, **kwargs: Any) -> PhaseResult:
        start = time.monotonic()
        result = run(*args, **kwargs)
        result.seconds = time.monotonic() - start
        return result

    return wrapper


def served_model(url: str, api_key: str | None, timeout_s: float = 60.0) -> str:
    """The name the server serves its model under (GET /v1/models)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{url}/v1/models", headers=headers, timeout=timeout_s)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


# ---- checks shared by the phases ---------------------------------------------------------------------


def error_shape_problem(r: httpx.Response) -> str | None:
    """What keeps a 4xx/5xx body from being OpenAI's error object, or None."""
    try:
        body = r.json()
    except ValueError:
        return f"error body is not JSON: {r.text[:120]!r}"
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return f"error body is not {{'error': {{...}}}}: {r.text[:160]!r}"
    e = body["error"]
    if set(e) != {"message", "type", "param", "code"}:
        return f"error fields are {sorted(e)}, not message/type/param/code"
    if not isinstance(e["message"], str) or not isinstance(e["type"], str):
        return f"error message/type are not strings: {e!r:.160}"
    if e["param"] is not None and not isinstance(e["param"], str):
        return f"error param is neither a string nor null: {e['param']!r}"
    if e["code"] is not None and (not isinstance(e["code"], (str, int)) or isinstance(e["code"], bool)):
        return f"error code is neither a string, an integer nor null: {e['code']!r}"
    if "Traceback" in e["message"]:
        return "error message holds a traceback"
    return None


def sse_events(text: str) -> tuple[list[dict], list[str]]:
    """The JSON events of a server-sent-events body, and what is wrong with it: every line is
    ``data: ...`` (or blank), each event JSON, the last ``data: [DONE]`` and only the last."""
    problems: list[str] = []
    lines = text.split("\n")
    others = [line for line in lines if line and not line.startswith("data: ")]
    if others:
        problems.append(f"lines that are not data events: {others[:2]!r}")
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    if not data or data[-1] != "[DONE]":
        problems.append(f"the stream does not end with data: [DONE] (ends {text[-80:]!r})")
    else:
        data = data[:-1]
    events = []
    for item in data:
        if item == "[DONE]":
            problems.append("data: [DONE] before the end of the stream")
            continue
        try:
            event = json.loads(item)
        except ValueError:
            problems.append(f"an event is not JSON: {item[:80]!r}")
            continue
        if not isinstance(event, dict):
            problems.append(f"an event is not an object: {item[:80]!r}")
            continue
        events.append(event)
    return events, problems


def stream_error_events(events: list[dict]) -> list[dict]:
    return [e["error"] for e in events if "error" in e]


def is_server_error(r: httpx.Response) -> bool:
    """A 5xx, or a 200 stream that ended in a server_error event."""
    if r.status_code >= 500:
        return True
    if r.status_code == 200 and is_sse(r):
        errors = stream_error_events(sse_events(r.text)[0])
        return any(isinstance(e, dict) and e.get("type") == "server_error" for e in errors)
    return False


def is_json(r: httpx.Response) -> bool:
    return r.headers.get("content-type", "").split(";")[0].strip() == "application/json"


def is_sse(r: httpx.Response) -> bool:
    return r.headers.get("content-type", "").split(";")[0].strip() == "text/event-stream"


def scrape_gauges(client: httpx.Client) -> dict[str, float]:
    """Every sample of GET /metrics (Prometheus text), summed over labels."""
    r = client.get("/metrics")
    r.raise_for_status()
    values: dict[str, float] = {}
    for line in r.text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        values[name] = values.get(name, 0.0) + float(value)
    return values


IDLE_GAUGES = ("dabba:num_requests_running", "dabba:num_requests_waiting", "dabba:kv_cache_usage_perc")


def wait_idle(target: Target, deadline_s: float = 60.0, idle_scrapes: int = 3) -> str | None:
    """Polls /metrics until no request runs or waits and no KV block is held, on ``idle_scrapes``
    scrapes in a row (a request a hung-up client sent may still be on its way into the engine
    at the first). The deadline only bounds a leak (a request or block that never goes away).
    Returns the problem, or None."""
    deadline = time.monotonic() + deadline_s
    in_a_row = 0
    with target.client() as client:
        while True:
            gauges = scrape_gauges(client)
            missing = [g for g in IDLE_GAUGES if g not in gauges]
            if missing:
                return f"/metrics lacks {missing}"
            in_a_row = in_a_row + 1 if all(gauges[g] == 0 for g in IDLE_GAUGES) else 0
            if in_a_row >= idle_scrapes:
                return None
            if time.monotonic() > deadline:
                return "the server did not settle within %.0f s: %s" % (
                    deadline_s, ", ".join(f"{g}={gauges[g]:g}" for g in IDLE_GAUGES))
            time.sleep(0.1)


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


# ---- phase 2: disconnect storm -----------------------------------------------------------------------

GREEDY = (
    ("completions", "The quick brown fox"),
    ("completions", PROMPTS[4]),  # several KV blocks long: its prefix is cached between the two runs
    ("chat", "What is JSON?"),
)
HANGUPS = ("before_first_byte", "after_first_chunk", "mid_stream", "non_stream")
GENERATED = "dabba:generation_tokens_total"


@dataclass(frozen=True)
class StormConfig:
    disconnects: int = 24
    workers: int = 8  # clients hanging up at once
    max_tokens: int = 384  # long enough that every hang-up finds its request running
    greedy_tokens: int = 24
    settle_timeout_s: float = 60.0  # bounds a leak only
    seed: int = 0


def greedy_outputs(target: Target, num_tokens: int) -> list[tuple[str, list[str]]]:
    """Text and tokens of each GREEDY prompt, one at a time on an idle server."""
    outputs = []
    with target.client() as client:
        for endpoint, prompt in GREEDY:
            body: dict[str, Any] = {"model": target.model, "max_tokens": num_tokens, "temperature": 0,
                                    "ignore_eos": True}
            if endpoint == "completions":
                r = client.post("/v1/completions", json={**body, "prompt": prompt, "logprobs": 0})
                r.raise_for_status()
                c = r.json()["choices"][0]
                outputs.append((c["text"], c["logprobs"]["tokens"]))
            else:
                r = client.post("/v1/chat/completions", json={
                    **body, "messages": [{"role": "user", "content": prompt}], "logprobs": True})
                r.raise_for_status()
                c = r.json()["choices"][0]
                outputs.append((c["message"]["content"], [t["token"] for t in c["logprobs"]["content"]]))
    return outputs


def raw_http_request(target: Target, path: str, body: dict) -> bytes:
    """An HTTP/1.1 POST as bytes, for clients that hang up on a bare socket."""
    url = urllib.parse.urlsplit(target.url)
    payload = json.dumps(body).encode()
    headers = {"Host": url.netloc, "Content-Type": "application/json", "Content-Length": str(len(payload)),
               **target.auth()}
    head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    return head.encode() + payload


def hang_up_raw(target: Target, path: str, body: dict, rng: random.Random) -> None:
    """Send the request on a bare socket and close it without reading a byte: at once or after a
    random moment, with a FIN or (half the time) a RST."""
    url = urllib.parse.urlsplit(target.url)
    if url.scheme != "http":
        raise ValueError("the storm's bare-socket clients speak plain http only")
    with socket.create_connection((url.hostname, url.port or 80), timeout=target.timeout_s) as sock:
        sock.sendall(raw_http_request(target, path, body))
        pause = rng.choice((0.0, 0.0, 0.01, 0.05, 0.2))  # where it lands varies; no check depends on it
        if pause:
            time.sleep(pause)
        if rng.random() < 0.5:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def hang_up_streaming(target: Target, path: str, body: dict, num_events: int) -> str | None:
    """Read ``num_events`` data events of a stream, then close the connection."""
    with target.client() as client, client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            r.read()
            return f"HTTP {r.status_code}: {r.text[:200]!r}"
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                if line == "data: [DONE]" or "error" in json.loads(line[len("data: "):]):
                    return f"the stream ended after {seen} events, before the hang-up point {num_events}: {line[:120]}"
                seen += 1
                if seen >= num_events:
                    return None
    return f"the stream ended after {seen} events, before the hang-up point {num_events}"


def storm_body(target: Target, rng: random.Random, stream: bool, max_tokens: int) -> tuple[str, dict]:
    n = min(rng.choice((1, 2)), target.limits.max_n)
    body: dict[str, Any] = {"model": target.model, "max_tokens": max_tokens, "n": n, "ignore_eos": True,
                            "stream": stream, "temperature": 1.0}
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": rng.choice(PROMPTS)}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}


def one_hang_up(target: Target, mode: str, seed: int, max_tokens: int) -> str | None:
    rng = random.Random(seed)
    path, body = storm_body(target, rng, stream=mode != "non_stream", max_tokens=max_tokens)
    if mode in ("before_first_byte", "non_stream"):
        hang_up_raw(target, path, body, rng)
        return None
    return hang_up_streaming(target, path, body, 1 if mode == "after_first_chunk" else rng.randint(2, 12))


@timed
def run_storm(target: Target, config: StormConfig = StormConfig()) -> PhaseResult:
    """Greedy outputs, then D clients hanging up at random points, then: the server settles (no
    request running or waiting, no KV block held) and the greedy outputs are the same."""
    result = PhaseResult("storm", {"disconnects": 0, "greedy_prompts": len(GREEDY)})
    problem = wait_idle(target, config.settle_timeout_s)
    if problem:
        result.failures.append(f"before the storm: {problem}")
    before = greedy_outputs(target, config.greedy_tokens)
    rng = random.Random(config.seed)
    plan = [(HANGUPS[i % len(HANGUPS)], rng.randrange(2**31)) for i in range(config.disconnects)]
    rng.shuffle(plan)
    with target.client() as client:
        generated = scrape_gauges(client).get(GENERATED, 0.0)

    def hang_up(item: tuple[str, int]) -> tuple[str, str | None]:
        mode, seed = item
        try:
            return mode, one_hang_up(target, mode, seed, config.max_tokens)
        except (OSError, ValueError, httpx.HTTPError) as e:
            return mode, f"{type(e).__name__}: {e}"

    with concurrent.futures.ThreadPoolExecutor(config.workers) as pool:
        for mode, problem in pool.map(hang_up, plan):
            if problem:
                result.failures.append(f"{mode}: {problem}")
            else:
                result.add("disconnects")
                result.add(mode)
    problem = wait_idle(target, config.settle_timeout_s)
    if problem:
        result.failures.append(f"after the storm: {problem}")
        return result
    with target.client() as client:  # reported: far fewer than max_tokens per sample, as requests were aborted
        result.counts["generated_tokens"] = int(scrape_gauges(client).get(GENERATED, 0.0) - generated)
    after = greedy_outputs(target, config.greedy_tokens)
    for (endpoint, prompt), b, a in zip(GREEDY, before, after):
        if a != b:
            result.failures.append(f"greedy {endpoint} {prompt[:30]!r} changed: {b[0]!r} -> {a[0]!r}")
        else:
            result.add("greedy_same")
    return result


# ---- phase 3: fuzz -----------------------------------------------------------------------------------

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
TEXT_BODIES = {"/metrics": "text/plain", "/health": ""}  # 2xx bodies that are not JSON: content type prefix


@dataclass(frozen=True)
class FuzzConfig:
    cases: int = 240  # in all; the POST operations share what the GETs leave, in both modes
    gets_per_operation: int = 2  # a GET without parameters has one case only
    max_tokens_cap: int = 8
    seed: int | None = 0  # None: a fresh hypothesis seed


def adjust_body(body: Any, cap: int, model: str | None) -> Any:
    """Generated generation bodies may ask for max_model_len tokens x n samples (and leaving
    max_tokens out means as many as fit): each length is lowered to ``cap`` tokens before
    sending, so a few hundred cases take seconds. Only valid lengths change; invalid ones (0,
    negative, floats, strings) reach the server as generated. ``model``: the served name, put in
    place of a generated string (else nearly every valid case would be a 404 for its model; the
    malformed table has the wrong names)."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if model is not None and isinstance(body.get("model"), str):
        body["model"] = model
    keys = ("max_tokens", "max_completion_tokens")
    for key in keys:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    if all(body.get(key) is None for key in keys):
        body["max_tokens"] = cap
    return body


def fuzz_response_problems(path: str, r: httpx.Response) -> list[str]:
    """Never a 5xx; 4xx in OpenAI's error shape; 2xx JSON, or a stream ending in [DONE]."""
    if r.status_code >= 500:
        return [f"HTTP {r.status_code}: {r.text[:200]!r}"]
    if 400 <= r.status_code < 500:
        problem = error_shape_problem(r)
        return [f"HTTP {r.status_code}: {problem}"] if problem else []
    if not 200 <= r.status_code < 300:
        return [f"unexpected HTTP {r.status_code}"]
    if is_sse(r):
        events, problems = sse_events(r.text)
        errors = stream_error_events(events)
        return problems + ([f"error events in a 200 stream: {errors[:2]}"] if errors else [])
    if is_json(r):
        try:
            r.json()
        except ValueError:
            return [f"a JSON content type with a body that is not JSON: {r.text[:120]!r}"]
        return []
    if path in TEXT_BODIES and r.headers.get("content-type", "").startswith(TEXT_BODIES[path]):
        return []
    return [f"HTTP {r.status_code} with content type {r.headers.get('content-type')!r}"]


def send_case(client: httpx.Client, target: Target, case: Any, cap: int, positive: bool
              ) -> tuple[str, httpx.Response]:
    """A schemathesis case sent with httpx (the same client for every case), its body adjusted
    (see adjust_body; the model name in positive cases only) and written with NaN/Infinity
    literals where generated."""
    kwargs = case.as_transport_kwargs(base_url=target.url, headers=target.auth())
    path = urllib.parse.urlsplit(kwargs["url"]).path
    content: bytes | None = None
    if "json" in kwargs:
        body = kwargs["json"]
        if path in GENERATION_PATHS:
            body = adjust_body(body, cap, target.model if positive else None)
        elif positive and isinstance(body, dict) and isinstance(body.get("model"), str):
            body = {**body, "model": target.model}
        content = json.dumps(body, allow_nan=True).encode()
    elif kwargs.get("data") is not None:
        data = kwargs["data"]
        content = data if isinstance(data, bytes) else str(data).encode()
    headers = {str(k): str(v) for k, v in (kwargs.get("headers") or {}).items()}
    r = client.request(kwargs["method"], kwargs["url"], params=kwargs.get("params") or None, headers=headers,
                       content=content, cookies=kwargs.get("cookies") or None)
    return path, r


def fuzz_operation(operation: Any, mode: Any, max_examples: int, seed: int | None,
                   check: Callable[[Any], None]) -> None:
    """Runs ``check`` on up to ``max_examples`` hypothesis-generated cases of one operation (no
    shrinking, no example database: a failure is recorded by ``check``, never raised)."""
    import hypothesis

    @hypothesis.settings(max_examples=max_examples, deadline=None, database=None, phases=[hypothesis.Phase.generate],
                         suppress_health_check=list(hypothesis.HealthCheck), verbosity=hypothesis.Verbosity.quiet)
    @hypothesis.given(operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        check(case)

    if seed is not None:
        run = hypothesis.seed(seed)(run)
    run()


def schema_operations(target: Target) -> Iterator[Any]:
    import schemathesis
    from schemathesis.core.result import Ok

    schema = schemathesis.openapi.from_url(f"{target.url}/openapi.json", timeout=target.timeout_s)
    for result in schema.get_all_operations():
        if isinstance(result, Ok):
            yield result.ok()


@timed
def run_fuzz(target: Target, config: FuzzConfig = FuzzConfig()) -> PhaseResult:
    """schemathesis cases of every operation in /openapi.json: the POSTs in positive and
    negative modes, the GETs positive (they take no parameters to break)."""
    from schemathesis import GenerationMode

    result = PhaseResult("fuzz", {"cases": 0})
    operations = list(schema_operations(target))
    posts = [op for op in operations if op.method.upper() == "POST"]
    gets = [op for op in operations if op.method.upper() != "POST"]
    result.counts["operations"] = len(operations)
    if not posts:
        result.failures.append("the schema has no POST operations")
        return result
    per_post = max(1, (config.cases - config.gets_per_operation * len(gets)) // (2 * len(posts)))
    plan = [(op, GenerationMode.POSITIVE, config.gets_per_operation) for op in gets]
    plan += [(op, mode, per_post) for op in posts for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
    with target.client(auth=False) as client:
        for k, (op, mode, max_examples) in enumerate(plan):
            label = f"{op.method.upper()} {op.path} {mode.value}"

            def check(case: Any) -> None:
                result.add("cases")
                result.add_to(label, "cases")
                try:
                    path, r = send_case(client, target, case, config.max_tokens_cap,
                                                positive=mode == GenerationMode.POSITIVE)
                except httpx.HTTPError as e:
                    result.failures.append(f"{label}: {type(e).__name__}: {e}")
                    return
                result.add(f"{r.status_code // 100}xx")
                result.add_to(label, str(r.status_code))
                result.server_errors += is_server_error(r)
                problems = fuzz_response_problems(path, r)
                if problems:
                    body = r.request.content[:300].decode(errors="replace")
                    result.failures += [f"{label}: {p} (request body {body!r})" for p in problems]

            try:
                fuzz_operation(op, mode, max_examples, None if config.seed is None else config.seed + k, check)
            except Exception as e:  # schemathesis/hypothesis could not generate (or send) its cases
                result.failures.append(f"{label}: fuzzing stopped: {type(e).__name__}: {e}")
    problem = wait_idle(target)
    if problem:
        result.failures.append(f"after the fuzz: {problem}")
    return result


# ---- phase 4: malformed requests ---------------------------------------------------------------------


@dataclass(frozen=True)
class BadRequest:
    """A request the server must refuse with ``status`` naming ``param`` (OpenAI's error shape)."""

    name: str
    path: str
    body: bytes | None
    status: int
    param: str | None
    method: str = "POST"
    content_type: str | None = "application/json"
    auth: bool = True
    or_param: tuple[str | None, ...] = ()  # also right: which check refuses it depends on the server's stack


def malformed_table(target: Target) -> list[BadRequest]:
    """The table, sized to the server's bounds; the 401 rows only when the server has a key."""
    limits, model = target.limits, json.dumps(target.model)
    chat = '{"model": %s, "messages": [{"role": "user", "content": %s}]%s}'

    def completion(extra: str, prompt: str = '"x"') -> bytes:
        return ('{"model": %s, "prompt": %s%s}' % (model, prompt, extra)).encode()

    def chat_body(content: str = '"hi"', extra: str = "") -> bytes:
        return (chat % (model, content, extra)).encode()

    too_many_stops = json.dumps([f"s{i}" for i in range(limits.max_stop_sequences + 1)])
    long_stop = json.dumps("x" * (limits.max_stop_length + 1))
    oversize = completion("", json.dumps("a" * limits.max_request_body_bytes))
    rows = [
        BadRequest("invalid JSON", "/v1/completions", b'{"prompt": "x",', 400, None),
        BadRequest("invalid JSON (chat)", "/v1/chat/completions", b'{"messages": [', 400, None),
        BadRequest("empty body", "/v1/completions", b"", 400, None),
        BadRequest("a JSON array body", "/v1/completions", b"[]", 400, None),
        BadRequest("wrong content type", "/v1/completions", completion(""), 400, None, content_type="text/plain"),
        BadRequest("lone surrogate in prompt", "/v1/completions", completion("", '"a\\ud800b"'), 400, "prompt"),
        BadRequest("lone surrogate in a prompt list", "/v1/completions", completion("", '["ok", "\\udfff"]'), 400,
                   "prompt"),
        BadRequest("lone surrogate in chat content", "/v1/chat/completions", chat_body('"hi \\ud800"'), 400,
                   "messages"),
        BadRequest("lone surrogate in a content part", "/v1/chat/completions",
                   chat_body('[{"type": "text", "text": "\\udc00"}]'), 400, "messages"),
        BadRequest("lone surrogate in the model name", "/v1/completions", b'{"model": "\\ud83d", "prompt": "x"}',
                   400, "model"),
        BadRequest("lone surrogate in /tokenize", "/tokenize", b'{"prompt": "\\ud800"}', 400, "prompt"),
        BadRequest("content part text a number", "/v1/chat/completions",
                   chat_body('[{"type": "text", "text": 5}]'), 400, "messages"),
        BadRequest("content part text a list", "/v1/chat/completions",
                   chat_body('[{"type": "text", "text": ["a"]}]'), 400, "messages"),
        BadRequest("content part without text", "/v1/chat/completions", chat_body('[{"type": "text"}]'), 400,
                   "messages"),
        BadRequest("temperature NaN", "/v1/completions", completion(', "temperature": NaN'), 400, "temperature"),
        BadRequest("temperature Infinity", "/v1/completions", completion(', "temperature": Infinity'), 400,
                   "temperature"),
        BadRequest("temperature -Infinity (chat)", "/v1/chat/completions",
                   chat_body(extra=', "temperature": -Infinity'), 400, "temperature"),
        BadRequest("top_p NaN", "/v1/completions", completion(', "top_p": NaN'), 400, "top_p"),
        BadRequest("top_p Infinity (chat)", "/v1/chat/completions", chat_body(extra=', "top_p": Infinity'), 400,
                   "top_p"),
        BadRequest("n too large", "/v1/completions", completion(f', "n": {limits.max_n + 1}'), 400, "n"),
        BadRequest("n too large (chat)", "/v1/chat/completions", chat_body(extra=f', "n": {limits.max_n + 1}'), 400,
                   "n"),
        BadRequest("too many stop strings", "/v1/completions", completion(f', "stop": {too_many_stops}'), 400, "stop"),
        BadRequest("too long a stop string", "/v1/completions", completion(f', "stop": {long_stop}'), 400, "stop"),
        BadRequest("too long a stop string (chat)", "/v1/chat/completions",
                   chat_body(extra=f', "stop": [{long_stop}]'), 400, "stop"),
        BadRequest('"yes" for stream', "/v1/completions", completion(', "stream": "yes"'), 400, "stream"),
        BadRequest('"yes" for ignore_eos (chat)', "/v1/chat/completions", chat_body(extra=', "ignore_eos": "yes"'),
                   400, "ignore_eos"),
        BadRequest('"true" for logprobs (chat)', "/v1/chat/completions", chat_body(extra=', "logprobs": "true"'),
                   400, "logprobs"),
        BadRequest("float token ids in prompt", "/v1/completions", completion("", "[1.0, 2.0]"), 400, "prompt"),
        BadRequest("float token ids in stop_token_ids", "/v1/completions", completion(', "stop_token_ids": [2.5]'),
                   400, "stop_token_ids"),
        BadRequest("float token ids in /detokenize", "/detokenize", b'{"tokens": [1.5, 2.0]}', 400, "tokens"),
        BadRequest("max_tokens a float", "/v1/completions", completion(', "max_tokens": 5.0'), 400, "max_tokens"),
        BadRequest("body over the size bound", "/v1/completions", oversize, 413, None),
        # Nested about as deep as the JSON parser takes (its limit is Python's recursion limit,
        # less the server's stack): these were 500s (and a dropped connection) when the lone-
        # surrogate walk recursed. Parsed, the prompt is refused ("prompt"); not parsed, the body.
        *(BadRequest(f"prompt nested {depth} deep", "/v1/completions",
                     completion("", "[" * depth + "]" * depth), 400, "prompt", or_param=(None,))
          for depth in (900, 940, 950, 955, 960, 965, 970, 980, 1000)),
        BadRequest("unknown route", "/v1/nothing-here", completion(""), 404, None),
        BadRequest("unknown route (GET)", "/v2/models", None, 404, None, method="GET", content_type=None),
        BadRequest("wrong method", "/v1/completions", None, 405, None, method="GET", content_type=None),
        BadRequest("wrong model name", "/v1/completions", b'{"model": "no-such-model", "prompt": "x"}', 404, "model"),
        BadRequest("wrong model name (chat)", "/v1/chat/completions",
                   b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
        BadRequest("wrong model name (/tokenize)", "/tokenize", b'{"model": "no-such-model", "prompt": "x"}', 404,
                   "model"),
    ]
    if target.api_key:
        rows += [
            BadRequest("missing API key", "/v1/completions", completion(""), 401, None, auth=False),
            BadRequest("missing API key (chat)", "/v1/chat/completions", chat_body(), 401, None, auth=False),
            BadRequest("missing API key (/detokenize)", "/detokenize", b'{"tokens": [1]}', 401, None, auth=False),
            BadRequest("missing API key (GET /v1/models)", "/v1/models", None, 401, None, method="GET",
                       content_type=None, auth=False),
        ]
    return rows


def bad_request_problems(r: httpx.Response, row: BadRequest) -> list[str]:
    problems = []
    if r.status_code != row.status:
        problems.append(f"HTTP {r.status_code}, expected {row.status}: {r.text[:160]!r}")
    shape = error_shape_problem(r)
    if shape:
        problems.append(shape)
    elif r.json()["error"]["param"] not in (row.param, *row.or_param):
        problems.append(f"param {r.json()['error']['param']!r}, expected {row.param!r}")
    return problems


def good_request_problem(client: httpx.Client, target: Target) -> str | None:
    """A normal request, as a check that the connection (and server) still serve."""
    r = client.post("/v1/completions", headers=target.auth(),
                    json={"model": target.model, "prompt": "ok", "max_tokens": 2, "ignore_eos": True})
    if r.status_code != 200 or r.json().get("usage", {}).get("completion_tokens") != 2:
        return f"the next good request got HTTP {r.status_code}: {r.text[:160]!r}"
    return None


@timed
def run_malformed(target: Target) -> PhaseResult:
    """Every row of the table on one client, each followed by a good request on it."""
    rows = malformed_table(target)
    result = PhaseResult("malformed", {"rows": len(rows), "passed": 0})
    with target.client(auth=False) as client:
        for row in rows:
            headers = {**(target.auth() if row.auth else {}),
                       **({"Content-Type": row.content_type} if row.content_type else {})}
            try:
                r = client.request(row.method, row.path, content=row.body, headers=headers)
            except httpx.HTTPError as e:
                problems = [f"{type(e).__name__}: {e}"]
            else:
                problems = bad_request_problems(r, row)
                result.server_errors += is_server_error(r)
            try:  # a server that dropped the connection after answering fails here
                after = good_request_problem(client, target)
            except httpx.HTTPError as e:
                after = f"the next good request failed: {type(e).__name__}: {e}"
            problems += [after] if after else []
            if problems:
                result.failures += [f"{row.name}: {p}" for p in problems]
            else:
                result.add("passed")
    return result


# ---- the script: a server of its own, rounds, the report ---------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """`dabba serve` started by the script, its log in a file (a chatty server never blocks)."""

    proc: subprocess.Popen
    url: str
    log_path: Path

    @classmethod
    def start(cls, model: str, limits: ServerConfig, api_key: str, extra: list[str],
              startup_timeout_s: float = 600.0) -> "ServerProcess":
        port = free_port()
        log_path = Path(tempfile.mkstemp(prefix="dabba-reliability-", suffix=".log")[1])
        command = [sys.executable, "-m", "dabba.entrypoints.cli", "serve", model, "--port", str(port),
                   "--api-key", api_key, "--max-n", str(limits.max_n),
                   "--max-stop-sequences", str(limits.max_stop_sequences),
                   "--max-stop-length", str(limits.max_stop_length),
                   "--max-request-body-bytes", str(limits.max_request_body_bytes),
                   "--shutdown-timeout", str(limits.shutdown_timeout), *extra]
        with open(log_path, "w") as log:  # run from the repository, whose dabba this suite checks
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        server = cls(proc, f"http://127.0.0.1:{port}", log_path)
        server.wait_ready(startup_timeout_s)
        return server

    def wait_ready(self, timeout_s: float) -> None:
        """Until GET /health is 200; the first start may build the native kernels (minutes)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=10).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the server did not come up in {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def rss_kib(self) -> int | None:
        """VmRSS of the server process, from /proc (Linux)."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except OSError:
            pass
        return None

    def stop(self, timeout_s: float) -> int:
        """SIGTERM, then its exit status (0: a clean drain); killed if it outlasts ``timeout_s``."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return -signal.SIGKILL

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def log_errors(self) -> list[str]:
        """Error lines of its log (it runs at --log-level warning): an unhandled exception, a
        traceback, an asyncio "exception was never retrieved" are bugs even when every client
        got the right answer."""
        return [line for line in self.log_path.read_text(errors="replace").splitlines()
                if line.startswith("ERROR") or "Traceback (most recent call last)" in line
                or "never retrieved" in line]


@dataclass(frozen=True)
class RunConfig:
    """One run of the script."""

    minutes: float = 0.0
    soak: SoakConfig = SoakConfig()
    storm: StormConfig = StormConfig()
    fuzz: FuzzConfig = FuzzConfig()
    seed: int = 0


def run_rounds(target: Target, config: RunConfig, log: Callable[[str], None],
               after_round: Callable[[], None] = lambda: None) -> tuple[list[dict], int]:
    """Phases 1-3 in rounds until ``config.minutes`` pass (at least one), then phase 4;
    ``after_round`` runs after each round (the script records the server's RSS)."""
    deadline = time.monotonic() + 60 * config.minutes
    phases: list[dict] = []
    rounds = 0
    while True:
        rounds += 1
        seed = config.seed + 1000 * rounds  # each round its own traffic and cases
        for run, phase_config in ((run_soak, dataclasses.replace(config.soak, seed=seed)),
                                  (run_storm, dataclasses.replace(config.storm, seed=seed)),
                                  (run_fuzz, dataclasses.replace(config.fuzz, seed=seed))):
            result = run(target, phase_config)
            phases.append({"round": rounds, **result.to_dict()})
            log(f"round {rounds} {result.phase}: {result.counts} failures={len(result.failures)} "
                f"({result.seconds:.1f} s)")
        after_round()
        if time.monotonic() >= deadline:
            break
    result = run_malformed(target)
    phases.append({"round": rounds, **result.to_dict()})
    log(f"malformed: {result.counts} failures={len(result.failures)}")
    return phases, rounds


def totals(phases: list[dict]) -> dict[str, int]:
    def total(phase: str, key: str) -> int:
        return sum(p.get(key, 0) for p in phases if p["phase"] == phase)

    return {"requests": total("soak", "requests"), "disconnects": total("storm", "disconnects"),
            "fuzz_cases": total("fuzz", "cases"), "malformed_rows": total("malformed", "rows"),
            "server_errors_5xx": sum(p["server_errors"] for p in phases),
            "failures": sum(p["num_failures"] for p in phases)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.reliability", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--model", default=DEMO_MODEL, help="the model of the server started here (default: the demo)")
    p.add_argument("--api-key", default=None, help="the key of --url's server (a started one gets a random key)")
    p.add_argument("--minutes", type=float, default=0.0, help="repeat phases 1-3 until this many minutes pass")
    p.add_argument("--clients", type=int, default=4, help="concurrent soak clients (default: 4)")
    p.add_argument("--requests-per-client", type=int, default=6, help="soak requests per client per round")
    p.add_argument("--disconnects", type=int, default=24, help="clients hanging up per round (default: 24)")
    p.add_argument("--fuzz-cases", type=int, default=240, help="schemathesis cases per round (default: 240)")
    p.add_argument("--seed", type=int, default=None, help="seed of the traffic and cases (default: random)")
    p.add_argument("--max-n", type=int, default=8, help="the server's --max-n (started here, or expected of --url)")
    p.add_argument("--max-stop-sequences", type=int, default=4)
    p.add_argument("--max-stop-length", type=int, default=64)
    p.add_argument("--max-request-body-bytes", default="1MiB")
    p.add_argument("--server-arg", action="append", default=[], help="an extra flag for the started server "
                   "(repeat; default: --dtype float32 --kv-cache-memory 64MiB --log-level warning)")
    p.add_argument("--json-out", default=None, help="also write the report to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from dabba.config import parse_bytes

    limits = ServerConfig(max_n=args.max_n, max_stop_sequences=args.max_stop_sequences,
                          max_stop_length=args.max_stop_length,
                          max_request_body_bytes=parse_bytes(args.max_request_body_bytes))
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    config = RunConfig(minutes=args.minutes, soak=SoakConfig(clients=args.clients,
                                                             requests_per_client=args.requests_per_client),
                       storm=StormConfig(disconnects=args.disconnects), fuzz=FuzzConfig(cases=args.fuzz_cases),
                       seed=seed)

    def log(line: str) -> None:
        print(f"[reliability] {line}", file=sys.stderr, flush=True)

    server: ServerProcess | None = None
    report: dict[str, Any] = {"seed": seed, "minutes": args.minutes}
    started = time.monotonic()
    try:
        if args.url is None:
            api_key = args.api_key or f"sk-{secrets.token_hex(8)}"
            extra = args.server_arg or ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--log-level", "warning"]
            log(f"starting the server for {args.model}")
            server = ServerProcess.start(args.model, limits, api_key, extra)
            url = server.url
            report["server_log"] = str(server.log_path)
        else:
            url, api_key = args.url.rstrip("/"), args.api_key
        target = Target(url=url, model=served_model(url, api_key), api_key=api_key, limits=limits)
        report.update(url=url, model=target.model)
        rss_start = server.rss_kib() if server else None
        rss_rounds: list[int | None] = []  # a leak grows round after round; warming up levels off
        phases, rounds = run_rounds(target, config, log,
                                    lambda: rss_rounds.append(server.rss_kib() if server else None))
        rss_end = server.rss_kib() if server else None
        report.update(rounds=rounds, totals=totals(phases), phases=phases,
                      rss_kib={"start": rss_start, "end": rss_end, "after_each_round": rss_rounds})
    finally:
        if server is not None:
            code = server.stop(limits.shutdown_timeout + 60)
            report["server_exit"] = code
            report["server_log_errors"] = server.log_errors()[:20]
            if code != 0:
                report["server_log_tail"] = server.log_tail()
    report["seconds"] = round(time.monotonic() - started, 1)
    ok = (report.get("totals", {}).get("failures", 1) == 0 and report.get("server_exit", 0) == 0
          and not report.get("server_log_errors"))
    if server is not None and ok:  # kept (its path in the report) only when it may explain a failure
        server.log_path.unlink(missing_ok=True)
        report.pop("server_log", None)
    report["ok"] = ok
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
