"""Phase 4, malformed requests: a table of bad requests, each with its expected status and
param, each followed by a good request on the same client; then requests broken below HTTP's
semantics (framing, the request line), sent on raw sockets, each answered in the error shape."""
from __future__ import annotations

import json
import socket
import urllib.parse
from dataclasses import dataclass

import httpx

from .common import PhaseResult, Target, error_shape_problem, is_server_error, timed


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
        BadRequest("a trailing slash (no redirect)", "/v1/completions/", completion(""), 404, None),
        BadRequest("a trailing slash (chat)", "/v1/chat/completions/", chat_body(), 404, None),
        BadRequest("unknown route (GET)", "/v2/models", None, 404, None, method="GET", content_type=None),
        BadRequest("wrong method", "/v1/completions", None, 405, None, method="GET", content_type=None),
        BadRequest("wrong model name", "/v1/completions", b'{"model": "no-such-model", "prompt": "x"}', 404, "model"),
        BadRequest("wrong model name (chat)", "/v1/chat/completions",
                   b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
        BadRequest("wrong model name (/tokenize)", "/tokenize", b'{"model": "no-such-model", "prompt": "x"}', 404,
                   "model"),
        # embeddings (the reliability server's model is a generator: it embeds too)
        BadRequest("invalid JSON (embeddings)", "/v1/embeddings", b'{"input": [', 400, None),
        BadRequest("no input (embeddings)", "/v1/embeddings", b'{"model": %s}' % model.encode(), 400, "input"),
        BadRequest("an empty input (embeddings)", "/v1/embeddings", b'{"input": ""}', 400, "input"),
        BadRequest("a token id out of range (embeddings)", "/v1/embeddings", b'{"input": [[1, 99999999]]}', 400,
                   "input"),
        BadRequest("dimensions on a model without Matryoshka", "/v1/embeddings", b'{"input": "x", "dimensions": 8}',
                   400, "dimensions"),
        BadRequest("wrong model name (embeddings)", "/v1/embeddings", b'{"model": "no-such-model", "input": "x"}',
                   404, "model"),
        # the Responses API (OpenAI's shape) and the Messages API (Anthropic's: no param)
        BadRequest("invalid JSON (responses)", "/v1/responses", b'{"input": [', 400, None),
        BadRequest("no input (responses)", "/v1/responses", b'{"model": %s}' % model.encode(), 400, "input"),
        BadRequest("an image item (responses)", "/v1/responses",
                   b'{"input": [{"type": "input_image", "image_url": "x"}]}', 400, "input"),
        BadRequest("a hosted tool (responses)", "/v1/responses", b'{"input": "x", "tools": [{"type": "web_search"}]}',
                   400, "tools"),
        BadRequest("an unknown previous_response_id", "/v1/responses",
                   b'{"input": "x", "previous_response_id": "resp_none"}', 404, "previous_response_id"),
        BadRequest("an unknown response (GET)", "/v1/responses/resp_none", None, 404, "response_id", method="GET",
                   content_type=None),
        BadRequest("cancel an unknown response", "/v1/responses/resp_none/cancel", None, 404, "response_id",
                   content_type=None),
        BadRequest("wrong model name (responses)", "/v1/responses", b'{"model": "no-such-model", "input": "x"}', 404,
                   "model"),
        BadRequest("invalid JSON (messages)", "/v1/messages", b'{"messages": [', 400, None),
        BadRequest("no max_tokens (messages)", "/v1/messages",
                   b'{"model": %s, "messages": [{"role": "user", "content": "x"}]}' % model.encode(), 400, None),
        BadRequest("a system role in messages", "/v1/messages",
                   b'{"model": %s, "max_tokens": 2, "messages": [{"role": "system", "content": "x"}]}'
                   % model.encode(), 400, None),
        BadRequest("an image block (messages)", "/v1/messages",
                   b'{"model": %s, "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image"}]}]}'
                   % model.encode(), 400, None),
        BadRequest("wrong model name (messages)", "/v1/messages",
                   b'{"model": "no-such-model", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}',
                   404, None),
        BadRequest("wrong model name (count_tokens)", "/v1/messages/count_tokens",
                   b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}', 404, None),
    ]
    if target.api_key:
        rows += [
            BadRequest("missing API key", "/v1/completions", completion(""), 401, None, auth=False),
            BadRequest("missing API key (chat)", "/v1/chat/completions", chat_body(), 401, None, auth=False),
            BadRequest("missing API key (responses)", "/v1/responses", b'{"input": "x"}', 401, None, auth=False),
            BadRequest("missing API key (messages)", "/v1/messages",
                       b'{"model": %s, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}'
                       % model.encode(), 401, None, auth=False),
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
    elif "param" in r.json()["error"] and r.json()["error"]["param"] not in (row.param, *row.or_param):
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
    run_raw(target, result)
    return result


# ---- below HTTP's semantics: raw sockets -------------------------------------------------------------

@dataclass(frozen=True)
class RawRequest:
    """Bytes the HTTP parser itself refuses (or a header no answer may echo), and the status due."""

    name: str
    data: bytes
    status: int
    must_not_contain: bytes | None = None


def raw_table(target: Target) -> list[RawRequest]:
    host = urllib.parse.urlsplit(target.url).netloc.encode()
    auth = "".join(f"{k}: {v}\r\n" for k, v in target.auth().items()).encode()
    body = json.dumps({"model": target.model, "prompt": "x", "max_tokens": 1}).encode()
    post = b"POST /v1/completions HTTP/1.1\r\nHost: " + host + b"\r\nContent-Type: application/json\r\n" + auth
    return [
        RawRequest("Content-Length: -5", post + b"Content-Length: -5\r\n\r\n" + body, 400),
        RawRequest("Content-Length not a number", post + b"Content-Length: ten\r\n\r\n" + body, 400),
        RawRequest("a malformed chunked body", post + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + body
                   + b"\r\n0\r\n\r\n", 400),
        RawRequest("a garbage request line", b"\x16\x03\x01 not http\r\n\r\n", 400),
        RawRequest("a trailing slash with a foreign Host", b"POST /v1/completions/ HTTP/1.1\r\nHost: evil.example.com"
                   b"\r\nContent-Type: application/json\r\n" + auth + b"Content-Length: %d\r\n\r\n" % len(body)
                   + body, 404, must_not_contain=b"evil.example.com"),
    ]


def raw_exchange(target: Target, data: bytes, timeout_s: float = 30.0) -> bytes:
    """Send ``data`` on a fresh connection and read what comes back until the server closes it
    or a full response with a Content-Length has come."""
    url = urllib.parse.urlsplit(target.url)
    with socket.create_connection((url.hostname, url.port or 80), timeout=timeout_s) as sock:
        sock.sendall(data)
        received = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            received += chunk
            head, sep, rest = received.partition(b"\r\n\r\n")
            length = [line.split(b":", 1)[1] for line in head.split(b"\r\n")[1:]
                      if line.lower().startswith(b"content-length:")]
            if sep and length and len(rest) >= int(length[0]):
                break
        return received


def raw_problems(row: RawRequest, received: bytes) -> list[str]:
    head, _, body = received.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].decode(errors="replace")
    parts = status_line.split(" ")
    if len(parts) < 2 or not parts[1].isdigit():
        return [f"no HTTP status line in {received[:120]!r}"]
    problems = []
    if int(parts[1]) != row.status:
        problems.append(f"HTTP {parts[1]}, expected {row.status}: {received[:200]!r}")
    if b"application/json" not in head.lower():
        problems.append(f"not a JSON error: {received[:200]!r}")
    else:
        shape = error_shape_problem(httpx.Response(int(parts[1]), content=body,
                                                   headers={"content-type": "application/json"}))
        if shape:
            problems.append(shape)
    if row.must_not_contain is not None and row.must_not_contain in received:
        problems.append(f"the response echoes {row.must_not_contain!r}: {received[:200]!r}")
    return problems


def run_raw(target: Target, result: PhaseResult) -> None:
    for row in raw_table(target):
        result.add("rows")
        try:
            problems = raw_problems(row, raw_exchange(target, row.data))
        except OSError as e:
            problems = [f"{type(e).__name__}: {e}"]
        if problems:
            result.failures += [f"{row.name}: {p}" for p in problems]
        else:
            result.add("passed")
