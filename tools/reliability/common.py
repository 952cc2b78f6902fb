"""What the phases share: the server under test (Target), a phase's result (PhaseResult,
`timed`) and the checks of error bodies, event streams and /metrics."""
from __future__ import annotations

import dataclasses
import functools
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from dabba.config import ServerConfig
from dabba.entrypoints.anthropic.errors import speaks_anthropic


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


def server_limits(url: str, api_key: str | None, timeout_s: float = 60.0) -> ServerConfig:
    """The bounds the server enforces (GET /server/limits), so that every table and case is sized
    to the server probed, whatever its flags."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{url}/server/limits", headers=headers, timeout=timeout_s)
    r.raise_for_status()
    known = {f.name for f in dataclasses.fields(ServerConfig)}
    return ServerConfig(**{name: value for name, value in r.json().items() if name in known})


def served_model(url: str, api_key: str | None, timeout_s: float = 60.0) -> str:
    """The name the server serves its model under (GET /v1/models)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{url}/v1/models", headers=headers, timeout=timeout_s)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


# ---- checks shared by the phases ---------------------------------------------------------------------


def error_shape_problem(r: httpx.Response) -> str | None:
    """What keeps a 4xx/5xx body from being the API's error object (OpenAI's; Anthropic's on the
    Messages API's paths), or None."""
    try:
        body = r.json()
    except ValueError:
        return f"error body is not JSON: {r.text[:120]!r}"
    if speaks_anthropic(request_path(r)):
        return anthropic_error_problem(body, r.text)
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


def request_path(r: httpx.Response) -> str:
    """The path ``r`` answered ("" for a response read off a raw socket, which has no request)."""
    try:
        return r.request.url.path
    except RuntimeError:
        return ""


def anthropic_error_problem(body: Any, text: str) -> str | None:
    """What keeps ``body`` from being Anthropic's error: {"type": "error", "error": {"type", "message"}}."""
    if not isinstance(body, dict) or set(body) != {"type", "error"} or body["type"] != "error" \
            or not isinstance(body["error"], dict):
        return f"error body is not {{'type': 'error', 'error': {{...}}}}: {text[:160]!r}"
    e = body["error"]
    if set(e) != {"type", "message"} or not isinstance(e["type"], str) or not isinstance(e["message"], str):
        return f"error fields are {sorted(e)}, not type/message (strings)"
    if "Traceback" in e["message"]:
        return "error message holds a traceback"
    return None


def named_events(path: str) -> bool:
    """Whether a stream from ``path`` is one of named events (Anthropic's and the Responses API's:
    ``event: NAME`` then ``data: {"type": NAME, ...}``, no [DONE]), not chat completions' data lines."""
    return speaks_anthropic(path) or path == "/v1/responses"


def sse_events(text: str, named: bool = False) -> tuple[list[dict], list[str]]:
    """The JSON events of a server-sent-events body, and what is wrong with it: every line is
    ``data: ...`` (or blank), each event JSON, the last ``data: [DONE]`` and only the last; or,
    ``named``, each ``data:`` line after an ``event:`` line naming its type, no [DONE]."""
    if named:
        return _named_events(text)
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


def _named_events(text: str) -> tuple[list[dict], list[str]]:
    problems: list[str] = []
    events: list[dict] = []
    name = None
    for line in text.split("\n"):
        if not line:
            continue
        if line.startswith("event: "):
            if name is not None:
                problems.append(f"an event line without its data: {name!r}")
            name = line[len("event: "):]
        elif line.startswith("data: "):
            try:
                event = json.loads(line[len("data: "):])
            except ValueError:
                problems.append(f"an event is not JSON: {line[:80]!r}")
                event = None
            if not isinstance(event, dict) or event.get("type") != name:
                problems.append(f"data of type {event.get('type') if isinstance(event, dict) else None!r} under "
                                f"event {name!r}")
            elif event is not None:
                events.append(event)
            name = None
        else:
            problems.append(f"a line that is neither event nor data: {line[:80]!r}")
    ends = {"message_stop", "response.completed", "response.incomplete", "error"}
    if not events or events[-1]["type"] not in ends:
        problems.append(f"the stream does not end with its last event (ends {text[-80:]!r})")
    return events, problems


def stream_error_events(events: list[dict]) -> list[dict]:
    """The error events' errors: OpenAI's {"error": {...}}, Anthropic's {"type": "error", "error":
    {...}}, the Responses API's {"type": "error", "code", "message"}."""
    return [e.get("error", e) for e in events if "error" in e or e.get("type") == "error"]


def is_server_error(r: httpx.Response) -> bool:
    """A 5xx, or a 200 stream that ended in a server_error event."""
    if r.status_code >= 500:
        return True
    if r.status_code == 200 and is_sse(r):
        errors = stream_error_events(sse_events(r.text, named_events(request_path(r)))[0])
        return any(isinstance(e, dict) and (e.get("type") in ("server_error", "api_error", "overloaded_error")
                                            or e.get("code") == "server_error") for e in errors)
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
