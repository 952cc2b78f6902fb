"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) driven by the official
`anthropic` SDK against a live server: a scripted model (tools/tiny_checkpoint.scripted_checkpoint)
that thinks and answers on cue, whole and streamed; a random-weight model through a tool loop that
tool_choice makes deterministic (its constraint); the one conversion to a chat request; and every
bad request answered in Anthropic's error shape with its status, never a 500."""
from __future__ import annotations

import json
from types import SimpleNamespace

import anthropic
import httpx
import jsonschema
import pytest

from dabba.entrypoints.anthropic.protocol import MessagesRequest
from dabba.entrypoints.anthropic.serving import AnthropicServing
from tests.entrypoints.live_server import live_server
from tests.entrypoints.test_tool_calls import WEATHER, tool_server
from tools.tiny_checkpoint import scripted_checkpoint

THINKING = ["<think>", "First, 2 + 2.", "</think>", "\n\nIt is 4."]
USER = [{"role": "user", "content": "What is 2 + 2?"}]
KEY = "sk-local"
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    path = scripted_checkpoint(tmp_path_factory.mktemp("scripted") / "model", THINKING)
    with live_server(str(path), "scripted", KEY, reasoning_parser="qwen3") as (url, _):
        yield SimpleNamespace(url=url, client=anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0))


def test_a_reply_is_thinking_and_text_blocks(thinking) -> None:
    message = thinking.client.messages.create(model="scripted", max_tokens=20, messages=USER)
    assert message.type == "message" and message.role == "assistant" and message.model == "scripted"
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", "First, 2 + 2."), ("text", "It is 4.")]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    count = thinking.client.messages.count_tokens(model="scripted", messages=USER)
    assert message.usage.input_tokens == count.input_tokens > 0
    assert message.usage.output_tokens == len(THINKING) + 1  # each piece is one token, then the EOS


def test_the_stream_is_anthropics_event_sequence_and_builds_the_same_message(thinking) -> None:
    with thinking.client.messages.stream(model="scripted", max_tokens=20, messages=USER) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    whole = thinking.client.messages.create(model="scripted", max_tokens=20, messages=USER)
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == whole.usage.output_tokens
    raw = [e for e in events if e not in ("text", "thinking", "signature", "input_json")]  # the SDK's own helpers
    assert raw[:1] == ["message_start"] and raw[-2:] == ["message_delta", "message_stop"]
    blocks = raw[1:-2]
    assert blocks.count("content_block_start") == blocks.count("content_block_stop") == 2
    # over the wire: the ping, and each block opened, filled and closed in turn
    r = httpx.post(f"{thinking.url}/v1/messages", headers={"x-api-key": KEY},
                   json={"model": "scripted", "max_tokens": 20, "messages": USER, "stream": True})
    names = [line.removeprefix("event: ") for line in r.text.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[2] == "content_block_start"
    for line in r.text.splitlines():
        if line.startswith("data: "):
            body = json.loads(line.removeprefix("data: "))
            if body["type"] == "content_block_start":
                assert body["content_block"]["type"] in ("thinking", "text")


@pytest.mark.parametrize("extra, stop_reason, stop_sequence, blocks", [
    ({"max_tokens": 2}, "max_tokens", None, [("thinking", "First, 2 + 2.")]),
    ({"stop_sequences": ["is 4"]}, "stop_sequence", "is 4", [("thinking", "First, 2 + 2."), ("text", "It ")]),
])
def test_stop_reasons(thinking, extra, stop_reason, stop_sequence, blocks) -> None:
    kw = {"model": "scripted", "max_tokens": 20, "messages": USER, **extra}
    with thinking.client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    for message in (thinking.client.messages.create(**kw), streamed):
        assert (message.stop_reason, message.stop_sequence) == (stop_reason, stop_sequence)
        assert [(b.type, getattr(b, "thinking", None) or b.text) for b in message.content] == blocks


def test_the_key_is_taken_as_x_api_key_or_bearer(thinking) -> None:
    body = {"model": "scripted", "max_tokens": 4, "messages": USER}
    assert httpx.post(f"{thinking.url}/v1/messages", json=body, headers={"authorization": f"Bearer {KEY}"}) \
        .status_code == 200
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=thinking.url, api_key="wrong", max_retries=0).messages.create(**body)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    assert e.value.body["type"] == "error"


@pytest.mark.parametrize("body, status, kind, counted", [
    # counted: count_tokens refuses it too (it reads no max_tokens, sampling or thinking budget)
    ({"model": "scripted", "messages": USER}, 400, "invalid_request_error", False),  # max_tokens is required
    ({"model": "other", "max_tokens": 4, "messages": USER}, 404, "not_found_error", True),
    ({"model": "scripted", "max_tokens": 0, "messages": USER}, 400, "invalid_request_error", False),
    ({"model": "scripted", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     400, "invalid_request_error", True),
    ({"model": "scripted", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
     400, "invalid_request_error", True),
    ({"model": "scripted", "max_tokens": 2000, "messages": USER, "thinking": {"type": "enabled",
                                                                             "budget_tokens": 100}},
     400, "invalid_request_error", False),
    ({"model": "scripted", "max_tokens": 4, "messages": USER, "tools": [
        {"type": "web_search_20250305", "name": "web_search", "input_schema": {"type": "object"}}]},
     400, "invalid_request_error", True),
    ({"model": "scripted", "max_tokens": 4, "messages": USER, "tool_choice": {"type": "tool"}, "tools": TOOLS},
     400, "invalid_request_error", True),
    ({"model": "scripted", "max_tokens": 4, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": "not an object"}]}]},
     400, "invalid_request_error", True),
    ({"model": "scripted", "max_tokens": 4, "messages": USER, "temperature": "hot"}, 400, "invalid_request_error",
     False),
])
def test_bad_requests_get_anthropics_error_shape(thinking, body, status, kind, counted) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens") if counted else ("/v1/messages",):
        r = httpx.post(f"{thinking.url}{path}", json=body, headers={"x-api-key": KEY})
        assert r.status_code == status and r.json()["type"] == "error", (path, r.text)
        assert r.json()["error"]["type"] == kind and r.json()["error"]["message"]
    r = httpx.post(f"{thinking.url}/v1/messages", content=b"{not json", headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# ---- the conversion: one Anthropic request, one chat request -----------------------------------------------------

def test_blocks_become_chat_messages() -> None:
    chat = AnthropicServing(chat=None).chat_request(MessagesRequest.model_validate({
        "model": "m", "max_tokens": 50, "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["END"], "temperature": 0.5, "top_k": 3,
        "thinking": {"type": "disabled"}, "tools": TOOLS,
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Need the tool.", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo", "unit": "c"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "-3 C"}]},
                {"type": "text", "text": "And tomorrow?"}]}]}))
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Need the tool.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "content": "-3 C", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And tomorrow?"}]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.parameters == WEATHER and chat.tools[0].function.description == "Weather in a city"
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_k) == (50, ["END"], 0.5, 3)
    assert chat.chat_template_kwargs == {"enable_thinking": False} and not chat.stream


def test_thinking_maps_to_the_template_and_the_budget() -> None:
    def converted(thinking: dict):
        return AnthropicServing(chat=None).chat_request(MessagesRequest.model_validate(
            {"model": "m", "max_tokens": 4096, "messages": USER, "thinking": thinking}))

    enabled = converted({"type": "enabled", "budget_tokens": 2048})
    assert enabled.chat_template_kwargs == {"enable_thinking": True} and enabled.max_thinking_tokens == 2048
    adaptive = converted({"type": "adaptive"})
    assert adaptive.chat_template_kwargs == {"enable_thinking": True} and adaptive.max_thinking_tokens is None
    assert converted({"type": "disabled"}).chat_template_kwargs == {"enable_thinking": False}


# ---- a tool loop on a random-weight model: tool_choice forces the call -----------------------------------------------

@pytest.fixture(scope="module")
def tools_server(checkpoints, tmp_path_factory):
    with tool_server(checkpoints, tmp_path_factory) as running:
        yield anthropic.Anthropic(base_url=running.url, api_key="none", max_retries=0)


def test_a_tool_loop(tools_server) -> None:
    """The model calls the tool (tool_choice names it: its input is constrained to the schema),
    the client runs it and returns the result, the model answers (tool_choice none)."""
    forced = dict(model="tiny", max_tokens=60, messages=USER, tools=TOOLS,
                  tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
    first = tools_server.messages.create(**forced)
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER)
    with tools_server.messages.stream(**forced) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", call.name, call.input)]
    turns = [*USER, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "-3 C"}]}]
    second = tools_server.messages.create(model="tiny", max_tokens=8, messages=turns, tools=TOOLS,
                                          tool_choice={"type": "none"}, extra_body={"temperature": 0})
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"]
    grown = tools_server.messages.count_tokens(model="tiny", messages=turns, tools=TOOLS)
    assert grown.input_tokens == second.usage.input_tokens > first.usage.input_tokens
