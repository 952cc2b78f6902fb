"""Requests that used to get a 500, an unbounded answer or a stalled event loop: each now gets a
400 (or 413) in OpenAI's error shape, on a connection that stays usable; the tokenizer and the
chat template run off the event loop; a drain refuses new requests and ends the ones it cuts
with an error."""
from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from dabba.config import ServerConfig
from dabba.engine.output_processor import IterationStats

from tests.entrypoints.live_server import live_server

API_KEY = "sk-hardening"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LIMITS = ServerConfig(max_n=4, max_stop_sequences=3, max_stop_length=8, max_request_body_bytes=64 * 1024)


@pytest.fixture(scope="module")
def server(checkpoints):
    state: dict = {}
    with live_server(str(checkpoints["llama"].path), MODEL, API_KEY, config=LIMITS, app_state=state) as (url, engine):
        with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
            yield SimpleNamespace(url=url, engine=engine, async_engine=state["engine"], client=client)


def raw_post(client: httpx.Client, path: str, body: str) -> httpx.Response:
    """A body as written (JSON escapes such as \\ud800 and literals such as NaN reach the server)."""
    return client.post(path, content=body.encode(), headers={"Content-Type": "application/json"})


def assert_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert "Traceback" not in error["message"]
    return error


def assert_still_serves(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"]}', "prompt"),
    ("/v1/completions", '{"model": "\\ud83d", "prompt": "x"}', "model"),
    ("/v1/completions", '{"prompt": "x", "stop": ["\\ud800"]}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
     '"function": {"name": "f", "description": "\\ud800"}}]}', "tools"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
])
def test_lone_surrogates_are_a_400_naming_where(server, path, body, param) -> None:
    error = assert_error(raw_post(server.client, path, body), 400, param)
    assert "surrogate" in error["message"]
    assert_still_serves(server.client)


def test_a_valid_surrogate_pair_is_a_character(server) -> None:
    r = raw_post(server.client, "/v1/completions", '{"prompt": "snake \\ud83d\\udc0d", "max_tokens": 2}')
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(server.engine.model_info.tokenizer.encode("snake \U0001f40d"))


@pytest.mark.parametrize("content", [
    [{"type": "text", "text": 5}], [{"type": "text"}], [{"type": "text", "text": ["a"]}],
    [{"type": "image_url", "image_url": {"url": "http://x"}}],
])
def test_content_parts_must_be_text(server, content) -> None:
    r = server.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
    assert_error(r, 400, "messages")
    assert_still_serves(server.client)


@pytest.mark.parametrize("body, param", [
    ('{"prompt": "x", "n": 5}', "n"),  # the server's max_n: 4
    ('{"prompt": "x", "n": 1000}', "n"),
    ('{"prompt": "x", "stop": ["a", "b", "c", "d"]}', "stop"),  # max_stop_sequences: 3
    ('{"prompt": "x", "stop": "much too long"}', "stop"),  # max_stop_length: 8
    ('{"prompt": "x", "temperature": NaN}', "temperature"),
    ('{"prompt": "x", "temperature": Infinity}', "temperature"),
    ('{"prompt": "x", "temperature": 1e300}', "temperature"),
    ('{"prompt": "x", "top_p": NaN}', "top_p"),
    ('{"prompt": "x", "top_k": 100000000000000000000}', "top_k"),
    ('{"prompt": "x", "top_k": 0}', "top_k"),
    ('{"prompt": "x", "repetition_penalty": Infinity}', "repetition_penalty"),
    ('{"prompt": "x", "repetition_penalty": 1e9}', "repetition_penalty"),
    ('{"prompt": "x", "presence_penalty": NaN}', "presence_penalty"),
    ('{"prompt": "x", "frequency_penalty": -Infinity}', "frequency_penalty"),
    ('{"prompt": "x", "min_p": NaN}', "min_p"),
    ('{"prompt": "x", "seed": 100000000000000000000000}', "seed"),
    ('{"prompt": "x", "seed": -100000000000000000000000}', "seed"),
    ('{"prompt": "x", "priority": 100000000000000000000000}', "priority"),
    ('{"prompt": "x", "logit_bias": {"5": NaN}}', "logit_bias"),
    # strict types, as OpenAI's API
    ('{"prompt": "x", "stream": "yes"}', "stream"),
    ('{"prompt": "x", "echo": 1}', "echo"),
    ('{"prompt": [1.0, 2.0]}', "prompt"),
    ('{"prompt": "x", "max_tokens": 5.0}', "max_tokens"),
    ('{"prompt": "x", "n": "2"}', "n"),
    ('{"prompt": "x", "stop_token_ids": [2.5]}', "stop_token_ids"),
    ('{"prompt": "x", "temperature": "0.5"}', "temperature"),
])
def test_bounds_and_strict_types(server, body, param) -> None:
    assert_error(raw_post(server.client, "/v1/completions", body), 400, param)


def test_chat_gets_the_same_bounds(server) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert_error(server.client.post("/v1/chat/completions", json={"messages": messages, "n": 9}), 400, "n")
    r = server.client.post("/v1/chat/completions", json={"messages": messages, "logprobs": "true"})
    assert_error(r, 400, "logprobs")


def test_numbers_in_range_are_served(server) -> None:
    body = {"prompt": "x", "max_tokens": 3, "n": 4, "stop": ["abc", "def", "12345678"], "temperature": 2.0,
            "top_k": 10**9, "seed": 2**64 - 5, "priority": -(2**63), "repetition_penalty": 1.5}
    r = server.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4


def test_a_body_past_the_bound_is_a_413_before_it_is_read(server) -> None:
    prompt = "word " * 20000  # 100 KB > 64 KiB
    r = server.client.post("/v1/completions", json={"prompt": prompt})
    error = assert_error(r, 413, None)
    assert str(LIMITS.max_request_body_bytes) in error["message"]

    def chunks():  # no Content-Length: the bound applies as the bytes arrive
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}'

    r = server.client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert_error(r, 413, None)
    assert_still_serves(server.client)


def test_tokenize_and_detokenize_need_the_key(server) -> None:
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1, 2]})):
        r = httpx.post(f"{server.url}{path}", json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert server.client.post(path, json=body).status_code == 200


class Gate:
    """Wraps a tokenizer call so that it waits, once entered, until the test releases it: while it
    waits, /health must still answer. Were the call on the event loop, /health could not answer
    and the test would fail at the client's timeout (a bound on a hang, not a timing)."""

    def __init__(self, fn):
        self.fn, self.entered, self.released = fn, threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        self.entered.set()
        assert self.released.wait(60), "never released"
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("what", ["encode", "apply_chat_template"])
def test_tokenization_and_templates_run_off_the_event_loop(server, monkeypatch, what) -> None:
    tokenizer = server.engine.model_info.tokenizer
    gate = Gate(getattr(tokenizer, what))
    monkeypatch.setattr(tokenizer, what, gate)
    body = ({"prompt": "held " * 100, "max_tokens": 2} if what == "encode"
            else {"messages": [{"role": "user", "content": "held"}], "max_tokens": 2})
    path = "/v1/completions" if what == "encode" else "/v1/chat/completions"
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(r=server.client.post(path, json=body)))
    worker.start()
    try:
        assert gate.entered.wait(60), "the request never reached the tokenizer"
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        assert server.client.get("/v1/models", timeout=30).status_code == 200
    finally:
        gate.released.set()
        worker.join(timeout=60)
    assert result["r"].status_code == 200, result["r"].text


def test_a_drain_refuses_new_requests_and_lets_running_ones_finish(checkpoints) -> None:
    state: dict = {}
    with live_server(str(checkpoints["llama"].path), MODEL, None, app_state=state) as (url, _):
        async_engine = state["engine"]
        body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        drained: dict = {}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = (line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: "))
            data = [next(lines)]  # in flight
            drainer = threading.Thread(target=lambda: drained.update(clean=async_engine.drain(60)))
            drainer.start()
            wait_for(lambda: async_engine.is_draining, "draining")
            refused = httpx.post(f"{url}/v1/completions", json={"prompt": "late"}, timeout=30)
            assert_error(refused, 503, None)
            assert httpx.get(f"{url}/health", timeout=30).status_code == 503
            data += list(lines)
        drainer.join(timeout=60)
        assert drained["clean"] is True
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["usage"]["completion_tokens"] == 200


def wait_for(condition, what: str) -> None:
    """Polls; the deadline bounds a hang only."""
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


class SteppedEngine:
    """Replaces an engine's step: "run" steps as usual, "hold" makes no progress (nothing in
    flight can finish), "fail" raises as a broken step would."""

    def __init__(self, engine) -> None:
        self.real_step, self.mode = engine.step_with_stats, "run"
        engine.step_with_stats = self.step

    def step(self):
        if self.mode == "fail":
            raise RuntimeError("injected failure")
        return ([], IterationStats()) if self.mode == "hold" else self.real_step()


def stream_and_single(url: str, engine, stepped: SteppedEngine, then) -> tuple[list[str], httpx.Response]:
    """A stream in flight and a single response waiting, both held in the engine while ``then()``
    runs; returns the stream's data lines and the single response."""
    single: dict = {}
    body = {"prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        lines = (line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: "))
        data = [next(lines)]
        stepped.mode = "hold"
        worker = threading.Thread(target=lambda: single.update(r=httpx.post(
            f"{url}/v1/completions", json={"prompt": "y", "max_tokens": 5}, timeout=60)))
        worker.start()
        wait_for(lambda: len(engine.output_processor.parents) == 2, "both requests in the engine")
        then()
        data += list(lines)
    worker.join(timeout=60)
    return data, single["r"]


def test_a_drain_that_times_out_ends_streams_and_single_responses_with_errors(checkpoints) -> None:
    state: dict = {}
    with live_server(str(checkpoints["llama"].path), MODEL, None, app_state=state) as (url, engine):
        stepped = SteppedEngine(engine)
        data, single = stream_and_single(url, engine, stepped, lambda: state.update(clean=state["engine"].drain(0.0)))
        assert state["clean"] is False
        assert data[-1] == "[DONE]"
        error = json.loads(data[-2])["error"]
        assert error["type"] == "server_error" and "did not finish in time" in error["message"]
        assert_error(single, 503, None)
        assert engine.output_processor.parents == {} and not engine.has_unfinished_requests()


def test_an_engine_failure_fails_what_is_in_flight_and_turns_health_to_503(checkpoints) -> None:
    with live_server(str(checkpoints["llama"].path), MODEL, None) as (url, engine):
        stepped = SteppedEngine(engine)
        data, single = stream_and_single(url, engine, stepped, lambda: setattr(stepped, "mode", "fail"))
        assert data[-1] == "[DONE]"
        error = json.loads(data[-2])["error"]
        assert error["type"] == "server_error" and "engine failed" in error["message"]
        assert "injected" not in error["message"]  # internals stay in the log
        assert_error(single, 503, None)
        assert httpx.get(f"{url}/health").status_code == 503
        assert_error(httpx.post(f"{url}/v1/completions", json={"prompt": "after"}), 503, None)
