"""Structured outputs over HTTP: OpenAI's response_format (with the official client's parse
helper) and vLLM's structured_outputs, streamed and not, and a 400 naming the field for every bad
constraint, with the other requests unaffected: one past the server's bounds, one that admits no
output, one that reaches a dead end as it generates (the body's error, the stream's error event),
one that does not compile by the server's deadline while a small one is served meanwhile."""
from __future__ import annotations

import json
import re
import threading
import time
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pydantic
import pytest

from dabba.config import ServerConfig
from dabba.structured_output.compile_pool import compiler_pool

from tests.entrypoints.live_server import live_server

MODEL = "tiny"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
                   "kind": {"enum": ["rain", "sun"]}},
    "required": ["city", "days", "kind"],
    "additionalProperties": False,
}


class Forecast(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=8)
    days: int = pydantic.Field(ge=1, le=9)
    kind: str = pydantic.Field(pattern="^(rain|sun)$")


@pytest.fixture(scope="module")
def server(checkpoints):
    with live_server(str(checkpoints["qwen2"].path), MODEL, None) as (url, engine):
        yield SimpleNamespace(url=url, engine=engine,
                              client=openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0))


MESSAGES = [{"role": "user", "content": "The weather as JSON"}]


def test_response_format_json_schema_streamed_and_not(server) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}
    for seed in range(4):
        r = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=1.0,
                                                  seed=seed, response_format=fmt)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        stream = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200,
                                                       temperature=1.0, seed=seed, response_format=fmt, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content


def test_the_openai_clients_parse_helper_round_trips_a_pydantic_model(server) -> None:
    for seed in range(3):
        r = server.client.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0.8,
                                                 seed=seed, response_format=Forecast)
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, Forecast) and parsed.kind in ("rain", "sun")


def test_json_object_and_structured_outputs_on_both_endpoints(server) -> None:
    r = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0,
                                              response_format={"type": "json_object"})
    assert r.choices[0].finish_reason in ("stop", "length")
    r = server.client.completions.create(model=MODEL, prompt="Pick:", max_tokens=20, temperature=1.0, seed=3, n=4,
                                         extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert len(r.choices) == 4 and all(c.text in ("left", "right") for c in r.choices)
    r = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0.9, seed=1,
                                              extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", r.choices[0].message.content)
    chunks = list(server.client.completions.create(
        model=MODEL, prompt="Sum:", max_tokens=40, temperature=0.9, seed=2, stream=True,
        extra_body={"structured_outputs": {"grammar": 'root ::= [1-9] ("+" [1-9]){1,3}'}}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert re.fullmatch(r"[1-9](\+[1-9]){1,3}", text) and chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("path, extra, param", [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ("chat", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
    ("completions", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"choice": "yes"}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"json": "{oops"}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs"),  # admits nothing
])
def test_bad_constraints_are_400s_naming_the_field(server, path, extra, param) -> None:
    body = {"model": MODEL, "max_tokens": 4, **extra}
    body.update({"messages": MESSAGES} if path == "chat" else {"prompt": "x"})
    url = f"{server.url}/v1/chat/completions" if path == "chat" else f"{server.url}/v1/completions"
    r = httpx.post(url, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert "Traceback" not in error["message"]
    ok = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200 and not server.engine.has_unfinished_requests()


HUGE_ENUM = {"enum": [f"value{i}" for i in range(100_000)]}  # xgrammar compiles it for minutes


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 8, **body}
    body.update({"messages": MESSAGES} if path == "chat" else {"prompt": "x"})
    return httpx.post(f"{server.url}/v1/{'chat/completions' if path == 'chat' else 'completions'}", json=body,
                      timeout=120, **kw)


@pytest.mark.parametrize("path, extra, param, message", [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": HUGE_ENUM}}},
     "response_format", "bytes of constraint; the server takes at most 65536 (its --max-constraint-bytes)"),
    ("completions", {"structured_outputs": {"json": {"enum": list(range(1001))}}}, "structured_outputs",
     "1001 enum/const values or choices; the server takes at most 1000"),
    ("completions", {"structured_outputs": {"choice": [str(i) for i in range(1001)]}}, "structured_outputs",
     "1001 enum/const values or choices"),
    ("completions", {"structured_outputs": {"regex": "a" * 4097}}, "structured_outputs",
     "4097 characters of regex; the server takes at most 4096 (its --max-constraint-regex-length)"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "string", "pattern": "b" * 4097}}}}, "response_format", "4097 characters of regex"),
    ("completions", {"structured_outputs": {"grammar": "root ::= r0\n" + "\n".join(
        f'r{i} ::= "a"' for i in range(1000))}}, "structured_outputs", "1001 grammar rules"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"k": {"enum": list(range(2000))}}}}}], "tool_choice": "required"},
     "tools", "enum/const values or choices"),
])
def test_constraints_past_the_bounds_are_400s_naming_the_field(server, path, extra, param, message) -> None:
    r = post(server, path, extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error == {"message": error["message"], "type": "invalid_request_error", "param": param,
                     "code": "constraint_too_large"}
    assert message in error["message"]


def test_a_dead_end_is_the_bodys_error_or_the_streams_error_event(server) -> None:
    dead_end = {"structured_outputs": {"grammar": 'root ::= "a" b\nb ::= b'}}
    r = post(server, "completions", dead_end)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "structured_outputs" and "dead end" in r.json()["error"]["message"]
    r = post(server, "chat", {**dead_end, "stream": True})
    assert r.status_code == 200
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "structured_outputs"
    assert "dead end" in error["message"]
    assert not server.engine.has_unfinished_requests()


def test_compiles_past_the_deadline_are_400s_and_hold_up_no_small_constraint(checkpoints) -> None:
    """The 100k-enum schema and the same strings as a regex's alternatives (tens of seconds to
    compile) at once, with bounds raised to let them in: each is a 400 at the deadline (the
    second from the large lane's queue, the first by killing its worker), while a small
    constraint sent meanwhile is served."""
    config = ServerConfig(structured_outputs_compile_timeout=5, max_constraint_bytes=4 * 2**20,
                          max_constraint_enum_values=200_000, max_constraint_regex_length=2**21)
    with live_server(str(checkpoints["qwen2"].path), MODEL, None, config=config) as (url, engine):
        server = SimpleNamespace(url=url)
        assert post(server, "completions", {"structured_outputs": {"regex": "[a-c]{2}"}}).status_code == 200
        huge = {"response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": HUGE_ENUM}}}
        regex = {"structured_outputs": {"regex": "(" + "|".join(f"value{i}" for i in range(100_000)) + ")"}}
        answers: dict[str, httpx.Response] = {}
        threads = [threading.Thread(target=lambda k=k, path=path, body=body: answers.update({k: post(server, path, body)}))
                   for k, path, body in (("enum", "chat", huge), ("regex", "completions", regex))]
        for thread in threads:
            thread.start()
        small = post(server, "completions", {"structured_outputs": {"regex": "[d-f]{4}"}})
        assert small.status_code == 200 and re.fullmatch("[d-f]{4}", small.json()["choices"][0]["text"])
        assert all(thread.is_alive() for thread in threads)  # the huge ones still compile: they hold up nothing
        for thread in threads:
            thread.join(timeout=120)
        for k, param in (("enum", "response_format"), ("regex", "structured_outputs")):
            error = answers[k].json()["error"]
            assert answers[k].status_code == 400 and error["param"] == param, answers[k].text
            assert "did not compile within 5 s (the server's --structured-outputs-compile-timeout)" in error["message"]
        wait_stopped(compiler_pool().lanes["large"])  # nobody waits for them any more
        assert not engine.has_unfinished_requests()


def wait_stopped(lane) -> None:
    """Until no compile is queued or running and the lane has killed its worker (it looks at its
    compile's claims every 50 ms; the bound is on a hang only)."""
    deadline = time.monotonic() + 60
    while compiler_pool().num_in_flight() or lane.worker is not None:
        assert time.monotonic() < deadline, "a compile went on with nobody waiting for it"
        time.sleep(0.05)


def test_a_client_that_hangs_up_stops_its_compile(checkpoints) -> None:
    """With a deadline of ten minutes, only the hang-up can stop the compile within the minute:
    a client that leaves while its compile runs, and one that leaves before it even began (its
    request still claiming it, the lane's worker starting)."""
    config = ServerConfig(structured_outputs_compile_timeout=600, max_constraint_bytes=4 * 2**20,
                          max_constraint_enum_values=200_000)
    pool, lane = compiler_pool(), compiler_pool().lanes["large"]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "structured_outputs": {"json": HUGE_ENUM}}
    with live_server(str(checkpoints["qwen2"].path), MODEL, None, config=config) as (url, engine):
        lane.ensure_worker()
        timed_out = threading.Event()

        def leave_after_a_second() -> None:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", timeout=1.0, json=body)
            timed_out.set()

        thread = threading.Thread(target=leave_after_a_second)
        thread.start()
        deadline = time.monotonic() + 60  # bounds on a hang only
        while pool.num_in_flight() == 0 and not timed_out.is_set():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert lane.running is not None or pool.num_in_flight() == 1  # compiling (or queued) as the client leaves
        thread.join(timeout=60)
        wait_stopped(lane)

        lane._stop_worker()  # cold: the request will still be starting the worker as its client leaves
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", timeout=0.5, json=body)
        while lane.worker is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        while pool.num_in_flight() or lane.running is not None:  # the claim made for nobody was released
            assert time.monotonic() < deadline, "a compile went on after its client left"
            time.sleep(0.05)
        assert not engine.has_unfinished_requests()
