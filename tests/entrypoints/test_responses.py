"""OpenAI's Responses API (/v1/responses) driven by the official `openai` SDK against a live server:
a scripted model (tools/tiny_checkpoint.scripted_checkpoint) that thinks and answers on cue (items,
usage with reasoning and cached tokens, the event stream, store and previous_response_id with its
eviction rule); a random-weight model through a tool loop that tool_choice makes deterministic,
and text.format's schema; cancel, against an engine client that never answers (the server talks
to engines only through that protocol); bad requests in OpenAI's error shape."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

from dabba.config import ServerConfig
from dabba.engine.model_info import ModelInfo
from dabba.engine.protocol import RequestStream
from dabba.engine.tokenizer import Tokenizer
from dabba.entrypoints.openai.api_server import build_app
from tests.entrypoints.live_server import live_server, serving
from tests.entrypoints.test_tool_calls import SCHEMAS, SEARCH, TEMPLATE as TOOL_TEMPLATE, WEATHER, tool_server
from tools.tiny_checkpoint import scripted_checkpoint

THINKING = ["<think>", "First, 2 + 2.", "</think>", "\n\nIt is 4."]
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
         {"type": "function", "name": "search", "parameters": SEARCH}]


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    path = scripted_checkpoint(tmp_path_factory.mktemp("scripted") / "model", THINKING)
    with live_server(str(path), "scripted", None, reasoning_parser="qwen3",
                     config=ServerConfig(max_stored_responses=3)) as (url, engine):
        yield SimpleNamespace(url=url, engine=engine,
                              client=openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0))


def texts(response) -> list[tuple[str, str]]:
    """(item type, its text) of each output item."""
    out = []
    for item in response.output:
        if item.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in item.content)))
        elif item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
        else:
            out.append((item.type, item.name, item.arguments))
    return out


def prompt_tokens(server, messages: list[dict]) -> int:
    return httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["count"]


def test_a_response_is_reasoning_and_message_items(thinking) -> None:
    r = thinking.client.responses.create(model="scripted", input="What is 2 + 2?", max_output_tokens=20)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert texts(r) == [("reasoning", "First, 2 + 2."), ("message", "It is 4.")]
    assert r.output_text == "It is 4."
    assert r.usage.input_tokens == prompt_tokens(thinking, [{"role": "user", "content": "What is 2 + 2?"}])
    assert r.usage.output_tokens == len(THINKING) + 1  # the pieces, then the EOS
    assert r.usage.output_tokens_details.reasoning_tokens == 3  # <think>, its text, </think>
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    again = thinking.client.responses.create(model="scripted", input="What is 2 + 2?", max_output_tokens=20)
    assert again.usage.input_tokens_details.cached_tokens > 0  # the prefix cache held the prompt's blocks
    cut = thinking.client.responses.create(model="scripted", input="What is 2 + 2?", max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert texts(cut) == [("reasoning", "First, 2 + 2.")]


def test_the_event_stream_builds_the_same_response(thinking) -> None:
    with thinking.client.responses.stream(model="scripted", input="What is 2 + 2?", max_output_tokens=20) as stream:
        events = list(stream)
        final = stream.get_final_response()
    whole = thinking.client.responses.create(model="scripted", input="What is 2 + 2?", max_output_tokens=20)
    assert texts(final) == texts(whole) and final.usage.output_tokens == whole.usage.output_tokens
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[-1].response.id == events[0].response.id


def test_store_previous_response_id_and_the_eviction_rule(thinking) -> None:
    client = thinking.client
    first = client.responses.create(model="scripted", input="Hi", instructions="Be brief.", max_output_tokens=20)
    assert texts(client.responses.retrieve(first.id)) == texts(first)
    second = client.responses.create(model="scripted", input="And again?", previous_response_id=first.id,
                                     max_output_tokens=20)
    # the earlier turn (its thinking too) comes before the new input; its instructions do not
    assert second.usage.input_tokens == prompt_tokens(thinking, [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "It is 4.", "reasoning_content": "First, 2 + 2."},
        {"role": "user", "content": "And again?"}])
    unstored = client.responses.create(model="scripted", input="Hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    # three kept (this server's --max-stored-responses): a fourth evicts the least recently used
    client.responses.retrieve(first.id)  # first is now used more recently than second
    third = client.responses.create(model="scripted", input="3", max_output_tokens=4)
    fourth = client.responses.create(model="scripted", input="4", max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    for kept in (first, third, fourth):
        assert client.responses.retrieve(kept.id).id == kept.id
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="scripted", input="x", previous_response_id=second.id)
    assert e.value.body["param"] == "previous_response_id"
    client.responses.delete(third.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(third.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(third.id)


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "max_output_tokens": 0}, "max_tokens"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text"),
    ({"input": 5}, "input"),
    ({}, "input"),
])
def test_bad_requests_are_400s_in_openais_shape(thinking, body, param) -> None:
    r = httpx.post(f"{thinking.url}/v1/responses", json={"model": "scripted", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["param"] in (param, None if param == "max_tokens" else param), r.text
    assert httpx.get(f"{thinking.url}/v1/responses/resp_nope").status_code == 404
    assert httpx.post(f"{thinking.url}/v1/responses/resp_nope/cancel").status_code == 404


# ---- tools on a random-weight model: tool_choice forces the call -------------------------------------------------

@pytest.fixture(scope="module")
def tools_server(checkpoints, tmp_path_factory):
    with tool_server(checkpoints, tmp_path_factory) as running:
        yield running


def test_a_tool_loop_with_function_call_output(tools_server) -> None:
    client = tools_server.client
    kw = dict(model="tiny", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
              max_output_tokens=80, temperature=0)
    first = client.responses.create(input="Weather in Oslo?", **kw)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with client.responses.stream(input="Weather in Oslo?", **kw) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        streamed = stream.get_final_response()
    assert deltas == call.arguments and texts(streamed) == texts(first)
    # the client runs the tool and continues the stored response with its output
    result = [{"type": "function_call_output", "call_id": call.call_id, "output": "-3 C"}]
    answer = client.responses.create(model="tiny", input=result, previous_response_id=first.id, tools=TOOLS,
                                     tool_choice="none", max_output_tokens=6, temperature=0)
    assert [item.type for item in answer.output] == ["message"]
    # the same conversation sent whole, without the store, reads the same
    whole = client.responses.create(model="tiny", tools=TOOLS, tool_choice="none", max_output_tokens=6,
                                    temperature=0, store=False, input=[
                                        {"role": "user", "content": "Weather in Oslo?"},
                                        {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                         "arguments": call.arguments}, *result])
    assert whole.usage.input_tokens == answer.usage.input_tokens and texts(whole) == texts(answer)


def test_required_tool_choice_and_text_format(tools_server) -> None:
    r = tools_server.client.responses.create(model="tiny", input="Find it.", tools=TOOLS, tool_choice="required",
                                             max_output_tokens=150, temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and all(jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name]) is None for c in calls)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = tools_server.client.responses.create(model="tiny", input="A number.", max_output_tokens=40, text={
        "format": {"type": "json_schema", "name": "number", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


# ---- cancel: an engine client that never answers, so the response is in progress when cancelled -----------------

class SilentEngine:
    """An EngineClient whose requests never produce an output: they end only when aborted."""

    def __init__(self, model_info: ModelInfo) -> None:
        self.model_info = model_info
        self.aborted: list[str] = []

    async def add_request(self, request_id, prompt, params, priority=0, compile_timeout=None,
                          lora_request=None) -> RequestStream:
        return RequestStream(request_id, asyncio.Queue(), self.abort)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def shutdown(self) -> None:
        pass


def test_cancel_stops_an_in_progress_response(checkpoints) -> None:
    path = checkpoints["qwen2"].path
    info = ModelInfo("Qwen2ForCausalLM", Tokenizer(path, chat_template=TOOL_TEMPLATE), 512, 1024, frozenset({1}), 16)
    engine = SilentEngine(info)
    with serving(build_app(engine, "tiny")) as url, httpx.Client(base_url=url) as client:
        with client.stream("POST", "/v1/responses", json={"input": "hi", "stream": True}) as stream:
            events = (json.loads(line.removeprefix("data: ")) for line in stream.iter_lines()
                      if line.startswith("data: "))
            created = next(events)
            assert created["type"] == "response.created"
            response_id = created["response"]["id"]
            assert client.get(f"/v1/responses/{response_id}").json()["status"] == "in_progress"
            cancelled = client.post(f"/v1/responses/{response_id}/cancel")
            assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
            rest = list(events)
        assert [e["type"] for e in rest] == ["response.in_progress", "response.incomplete"]
        assert rest[-1]["response"]["status"] == "cancelled"
        assert response_id in engine.aborted
        assert client.get(f"/v1/responses/{response_id}").json()["status"] == "cancelled"
        again = client.post(f"/v1/responses/{response_id}/cancel")
        assert again.status_code == 400 and again.json()["error"]["type"] == "invalid_request_error"
