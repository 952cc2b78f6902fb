"""Structured outputs over HTTP: OpenAI's response_format (with the official client's parse
helper) and vLLM's structured_outputs, streamed and not, and a 400 naming the field for every bad
constraint, with the other requests unaffected."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pydantic
import pytest

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
