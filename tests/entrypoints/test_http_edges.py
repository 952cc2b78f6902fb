"""The HTTP edges of `dabba serve`, on serve()'s own uvicorn config (dabba's h11 protocol) over
real sockets: no redirect built from the Host header, a 400 in OpenAI's error shape for what h11
cannot parse, a 408 for a request head that arrives too slowly, a 503 past --max-connections,
and GET /server/limits."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import select
import socket
import threading
import time
from types import SimpleNamespace
from typing import Iterator

import httpx
import pytest
import uvicorn

from dabba.config import DEMO_MODEL, EngineConfig, ServerConfig
from dabba.engine.clients import make_engine_client
from dabba.engine.llm_engine import LLMEngine
from dabba.entrypoints.openai.api_server import build_app
from dabba.entrypoints.openai.run_server import uvicorn_config
from dabba.entrypoints.openai.http_protocol import raise_open_file_limit

API_KEY = "sk-edges"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "demo"
HANG = 30.0  # a bound on a hang only: every wait below ends on an event long before it
HEAD_TIMEOUT = ServerConfig(timeout_request_head=1.0, max_n=3)
CAPPED = ServerConfig(max_connections=4)


@contextlib.contextmanager
def running(config: ServerConfig) -> Iterator[SimpleNamespace]:
    """serve()'s app and uvicorn config on a free loopback port (bound here and handed over, so no
    other process takes it in between), around the demo model with a small KV cache."""
    engine = LLMEngine(EngineConfig.from_kwargs(model=DEMO_MODEL, dtype="float32", max_num_batched_tokens=256,
                                                kv_cache_memory=2**24))
    app = build_app(make_engine_client(engine, MODEL), MODEL, api_key=API_KEY, config=config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, config, "warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive(), "server failed to start (see its log above)"
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield SimpleNamespace(port=port, url=f"http://127.0.0.1:{port}", server=server)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        engine.shutdown()


@pytest.fixture(scope="module")
def server() -> Iterator[SimpleNamespace]:
    with running(HEAD_TIMEOUT) as s:
        yield s


@pytest.fixture(scope="module")
def capped() -> Iterator[SimpleNamespace]:
    with running(CAPPED) as s:
        yield s


class Raw:
    """A client socket that writes bytes as given and reads responses by their Content-Length."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=HANG)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def readable(self, wait: float) -> bool:
        return bool(self.buffer) or bool(select.select([self.sock], [], [], wait)[0])

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buffer += chunk
        return bool(chunk)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            assert self._fill(), f"connection closed before a response head: {self.buffer!r}"
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        assert status_line.startswith("HTTP/1.1 "), status_line
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            assert name.lower() not in headers, f"repeated header {name}"
            headers[name.lower()] = value.strip()
        length = int(headers["content-length"])
        while len(self.buffer) < length:
            assert self._fill(), "connection closed inside a response body"
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(status_line.split()[1]), headers, body

    def closed_by_server(self) -> bool:
        """True once the server has ended the connection (EOF, or a reset after it)."""
        try:
            return not self.buffer and not self._fill()
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def assert_error_shape(body: bytes, type: str, code: str | None) -> str:
    error = json.loads(body)["error"]
    assert error == {"message": error["message"], "type": type, "param": None, "code": code}
    assert "Traceback" not in error["message"] and "h11" not in error["message"]
    return error["message"]


def assert_refused(raw: Raw, status: int, type: str, code: str) -> str:
    got, headers, body = raw.response()
    assert got == status, body
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    assert raw.closed_by_server()
    return assert_error_shape(body, type, code)


@pytest.mark.parametrize("method, path", [
    ("POST", "/v1/completions/"), ("POST", "/v1/chat/completions/"), ("GET", "/v1/models/"), ("GET", "/health/"),
    ("GET", "/server/limits/"), ("GET", "/engine/stats/"), ("GET", "/dashboard/"), ("GET", "/static"),
])
def test_trailing_slash_is_a_404_not_a_redirect(server, method, path) -> None:
    r = httpx.request(method, server.url + path, headers={**AUTH, "Host": "evil.example.com"},
                      json={"prompt": "x"} if method == "POST" else None, follow_redirects=False, timeout=HANG)
    assert r.status_code == 404, r.text
    assert_error_shape(r.content, "invalid_request_error", "not_found")
    assert r.json()["error"]["message"] == f"Route {path} not found"
    assert "location" not in r.headers
    assert "evil" not in r.text and not any("evil" in v for v in r.headers.values())


@pytest.mark.parametrize("request_bytes, status, message", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: -5\r\n\r\n{}",
     400, "invalid HTTP request: bad Content-Length"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode() + b"\r\n"
     b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
     400, "invalid HTTP request: illegal chunk header"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode() + b"\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}XX0\r\n\r\n",
     400, "invalid HTTP request: malformed chunk footer"),
    (b"GARBAGE\r\n\r\n", 400, "invalid HTTP request: illegal request line"),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 400, "invalid HTTP request: illegal request line"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: secret\r\n\r\n", 400,
     "invalid HTTP request: illegal header line"),  # without the client's bytes
    (b"GET /health HTTP/1.1\r\n\r\n", 400, "invalid HTTP request: Missing mandatory Host: header"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501,
     "invalid HTTP request: Only Transfer-Encoding: chunked is supported"),
])
def test_unparsable_requests_get_the_error_shape(server, request_bytes, status, message) -> None:
    raw = Raw(server.port)
    try:
        raw.send(request_bytes)
        assert assert_refused(raw, status, "invalid_request_error", "invalid_http_request") == message
    finally:
        raw.close()
    assert httpx.get(server.url + "/health", timeout=HANG).status_code == 200


def test_a_malformed_body_the_app_is_reading_gets_a_400(server) -> None:
    raw = Raw(server.port)
    try:
        raw.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode() + b"\r\n"
                 b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{\"\r\n")
        time.sleep(0.3)  # the handler starts reading the body (the answer is the same if it has not yet)
        raw.send(b"zz\r\n")
        message = assert_refused(raw, 400, "invalid_request_error", "invalid_http_request")
        assert message == "invalid HTTP request: illegal chunk header"
    finally:
        raw.close()
    assert httpx.get(server.url + "/health", timeout=HANG).status_code == 200


def test_an_oversized_head_is_a_431(server) -> None:
    raw = Raw(server.port)
    try:
        raw.send(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70000)  # h11 stops waiting past its bound
        message = assert_refused(raw, 431, "invalid_request_error", "invalid_http_request")
        assert message.startswith("the request line and headers are larger than ")
    finally:
        raw.close()


SLOW_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000 + b"\r\n\r\n"


def dribble(raws: list[Raw], heads: list[bytes]) -> list[tuple[int, dict[str, str], bytes]]:
    """Each client sends its head one byte every 0.2 s until the server answers; returns the answers."""
    answers: dict[int, tuple[int, dict[str, str], bytes]] = {}
    sent = [0] * len(raws)
    deadline = time.monotonic() + HANG
    while len(answers) < len(raws):
        assert time.monotonic() < deadline, "no answer to a slow head"
        for i, raw in enumerate(raws):
            if i in answers:
                continue
            if raw.readable(0):
                answers[i] = raw.response()
                assert raw.closed_by_server()
            else:
                assert sent[i] < len(heads[i]), "the whole head went out slowly and was served"
                raw.send(heads[i][sent[i]:sent[i] + 1])
                sent[i] += 1
        time.sleep(0.2)
    return [answers[i] for i in range(len(raws))]


def test_slow_request_heads_get_a_408_while_others_are_served(server) -> None:
    raws = [Raw(server.port) for _ in range(3)]
    try:
        for raw in raws:
            raw.send(SLOW_HEAD[:5])
        with httpx.Client(base_url=server.url, timeout=HANG) as client:
            assert client.get("/health").status_code == 200  # while every slow head is still arriving
            answers = dribble(raws, [SLOW_HEAD[5:]] * len(raws))
            assert client.get("/health").status_code == 200
    finally:
        for raw in raws:
            raw.close()
    for status, headers, body in answers:
        assert status == 408
        assert headers["connection"] == "close" and headers["content-type"] == "application/json"
        message = assert_error_shape(body, "invalid_request_error", "request_timeout")
        assert "--timeout-request-head" in message


def test_a_silent_connection_gets_a_408(server) -> None:
    raw = Raw(server.port)
    try:
        assert raw.readable(HANG)
        assert "--timeout-request-head" in assert_refused(raw, 408, "invalid_request_error", "request_timeout")
    finally:
        raw.close()


def test_a_slow_second_head_on_a_keep_alive_connection_gets_a_408(server) -> None:
    raw = Raw(server.port)
    try:
        raw.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, _ = raw.response()
        assert status == 200 and "connection" not in headers  # kept alive
        [(status, headers, body)] = dribble([raw], [SLOW_HEAD])
        assert status == 408 and headers["connection"] == "close"
        assert_error_shape(body, "invalid_request_error", "request_timeout")
    finally:
        raw.close()


def test_keep_alive_requests_are_unaffected(server) -> None:
    raw = Raw(server.port)
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    try:
        raw.send(request)
        assert raw.response()[0] == 200
        # idle past the head deadline (less than uvicorn's keep-alive): the deadline runs only
        # once a head begins
        assert not raw.readable(HEAD_TIMEOUT.timeout_request_head + 0.5)
        raw.send(request)
        assert raw.response()[0] == 200
        raw.send(request * 3)  # pipelined
        assert [raw.response()[0] for _ in range(3)] == [200] * 3
        body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
        raw.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode() + b"\r\n"
                 b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        status, _, response = raw.response()
        assert status == 200 and json.loads(response)["usage"]["completion_tokens"] == 2
        assert not raw.readable(0)
    finally:
        raw.close()


def test_connections_past_the_cap_get_a_503(capped) -> None:
    held = [Raw(capped.port) for _ in range(CAPPED.max_connections)]
    extra = Raw(capped.port)
    try:
        message = assert_refused(extra, 503, "server_error", "too_many_connections")
        assert str(CAPPED.max_connections) in message
        assert not any(raw.readable(0) for raw in held)  # still open, unanswered
        held[0].send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert held[0].response()[0] == 200
        held.pop().close()
        deadline = time.monotonic() + HANG
        while True:  # the server sees the close a moment later; then the slot is free again
            assert time.monotonic() < deadline, "a closed connection's slot was not freed"
            again = Raw(capped.port)
            try:
                again.send(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                status = again.response()[0]
            except (ConnectionResetError, BrokenPipeError):  # refused and closed before our request went out
                status = 503
            finally:
                again.close()
            if status == 200:
                break
            assert status == 503
            time.sleep(0.1)
    finally:
        extra.close()
        for raw in held:
            raw.close()


def test_server_limits_need_the_key_and_give_the_config(server) -> None:
    r = httpx.get(server.url + "/server/limits", timeout=HANG)
    assert r.status_code == 401
    assert_error_shape(r.content, "authentication_error", "invalid_api_key")
    r = httpx.get(server.url + "/server/limits", headers=AUTH, timeout=HANG)
    assert r.status_code == 200
    assert r.json() == dataclasses.asdict(HEAD_TIMEOUT)
    assert r.json()["timeout_request_head"] == 1.0 and r.json()["max_n"] == 3


def test_open_file_limit_warns_when_connections_cannot_fit(dabba_log) -> None:
    raise_open_file_limit(10**12)
    warnings = [r for r in dabba_log if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--max-connections" in warnings[0].getMessage()
    dabba_log.clear()
    raise_open_file_limit(16)
    assert not [r for r in dabba_log if r.levelno == logging.WARNING]
