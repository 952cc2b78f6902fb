"""Tool calling: the parsers on hand-written replies (streamed in pieces = read whole), and over
HTTP a random-weight model whose calls validate because tool_choice constrains them, "auto"
read by the hermes parser, streamed deltas that reassemble to the non-streamed message, the chat
template fed tools and tool messages, and 400s for bad tool requests."""
from __future__ import annotations

import contextlib
import json
import random
import shutil
from types import SimpleNamespace
from typing import Iterator

import httpx
import jsonschema
import openai
import pytest

from dabba.entrypoints.openai.tool_calls import (HermesExtractor, Llama3JsonExtractor, NamedExtractor,
                                                 RequiredExtractor, required_schema)

from tests.entrypoints.live_server import live_server

MODEL = "tiny"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 10},
                                           "limit": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["query"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
# A Qwen-like template: tools in a system turn, calls as <tool_call> blocks, results as tool turns.
TEMPLATE = (
    "{% if tools %}<|system|>\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</s>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|assistant|>\n{{ m.content }}"
    "{% for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}</s>\n"
    "{% elif m.role == 'tool' %}<|tool|>\n<tool_response id={{ m.tool_call_id }}>{{ m.content }}</tool_response></s>\n"
    "{% else %}<|{{ m.role }}|>\n{{ m.content }}</s>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def split_feed(extractor, text: str, seed: int):
    """Feed ``text`` in random pieces; returns (content, calls) as a stream delivers them."""
    rng = random.Random(seed)
    content, calls, i = "", [], 0
    while i < len(text):
        j = min(len(text), i + rng.randint(1, 7))
        news = extractor.feed(text[i:j])
        content, calls, i = content + news.content, calls + news.calls, j
    news = extractor.finish()
    return content + news.content or None, [(c.name, json.loads(c.arguments)) for c in calls + news.calls]


@pytest.mark.parametrize("text, content, calls", [
    ("Plain answer, no tools.", "Plain answer, no tools.", []),
    ("Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
     "Let me check.\n", [("get_weather", {"city": "Paris"})]),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": [1]}}'
     '</tool_call>', None, [("a", {}), ("b", {"x": [1]})]),
    ('<tool_call>{"name": "a", "arguments": "{\\"k\\": 2}"}</tool_call>', None, [("a", {"k": 2})]),  # string arguments
    ('<tool_call>not json</tool_call><tool_call>{"name": "ok", "arguments": {}}', None, [("ok", {})]),  # unclosed last
    ("a < b and <tool", "a < b and <tool", []),  # a partial marker at the end is content after all
])
def test_hermes(text, content, calls) -> None:
    for seed in range(5):
        assert split_feed(HermesExtractor(), text, seed) == (content, calls)
    read_content, read_calls = HermesExtractor().read(text)
    assert (read_content, [(c.name, json.loads(c.arguments)) for c in read_calls]) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    (' <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"n": 1}}', None,
     [("a", {}), ("b", {"n": 1})]),
    ("The answer is 4.", "The answer is 4.", []),
    ('{"not": "a call"}', '{"not": "a call"}', []),
    ('{"name": "a", "parameters": {', '{"name": "a", "parameters": {', []),  # cut off: content after all
])
def test_llama3_json(text, content, calls) -> None:
    for seed in range(5):
        assert split_feed(Llama3JsonExtractor(), text, seed) == (content, calls)


def test_required_and_named_readers() -> None:
    text = '[{"name": "search", "parameters": {"query": "x"}}, {"name": "get_weather", "parameters": {"city": "a"}}]'
    for seed in range(5):
        assert split_feed(RequiredExtractor(), text, seed) == (
            None, [("search", {"query": "x"}), ("get_weather", {"city": "a"})])
    assert NamedExtractor("f").read('{"a": 1}')[1][0].arguments == '{"a": 1}'
    schema = required_schema([{"name": "f", "parameters": WEATHER}], parallel=False)
    jsonschema.validate([{"name": "f", "parameters": {"city": "x", "unit": "c"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"city": "x", "unit": "c"}}] * 2, schema)


@contextlib.contextmanager
def tool_server(checkpoints, tmp_path_factory) -> Iterator[SimpleNamespace]:
    """The tiny Qwen2 with TEMPLATE, served with the hermes parser (these tests', and the other
    APIs' tool loops): its url, engine, path and an OpenAI client."""
    path = tmp_path_factory.mktemp("tools") / "model"
    shutil.copytree(checkpoints["qwen2"].path, path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    with live_server(str(path), MODEL, None, tool_call_parser="hermes") as (url, engine):
        yield SimpleNamespace(url=url, engine=engine, path=path,
                              client=openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0))


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    with tool_server(checkpoints, tmp_path_factory) as running:
        yield running


def reassemble(stream) -> tuple[str | None, list[dict], str]:
    """Streamed chunks -> (content, calls as the non-streamed message lists them, finish reason)."""
    content, calls, finish = None, {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for d in delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                assert (d.id is None) == (call["id"] is not None), "the id comes once, first"
                call["id"] = call["id"] or d.id
                call["name"] = call["name"] or d.function.name
                call["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


def as_dicts(message) -> list[dict]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]


def check_calls(calls: list[dict]) -> None:
    assert calls and len({c["id"] for c in calls}) == len(calls)
    for call in calls:
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "search"}}])
def test_forced_tool_choice_validates_streamed_and_not(server, tool_choice) -> None:
    for seed in range(4):
        kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=150,
                  temperature=1.0, seed=seed)
        r = server.client.chat.completions.create(**kw)
        message = r.choices[0].message
        calls = as_dicts(message)
        check_calls(calls)
        # "required" lets a weak model call again and again: max_tokens may cut the last call, not the others
        assert r.choices[0].finish_reason == "tool_calls" or (tool_choice == "required" and r.usage.completion_tokens
                                                              == 150 and r.choices[0].finish_reason == "length")
        assert not message.content
        if isinstance(tool_choice, dict):
            assert [c["name"] for c in calls] == ["search"]
        content, streamed, finish = reassemble(server.client.chat.completions.create(**kw, stream=True))
        assert not content and finish == r.choices[0].finish_reason
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c["name"], c["arguments"]) for c in calls]


def test_parallel_tool_calls_false_gives_one_call(server) -> None:
    for seed in range(3):
        r = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                  parallel_tool_calls=False, max_tokens=150, temperature=1.0, seed=seed)
        assert len(r.choices[0].message.tool_calls) == 1


def test_auto_reads_hermes_calls_streamed_and_not(server) -> None:
    """A regex holds the random model to what a hermes model writes; auto tool choice reads it."""
    reply = r'Checking\.\n<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", "unit": "[cf]"\}\}</tool_call>'
    for seed in range(3):
        kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=150, temperature=1.0, seed=seed,
                  extra_body={"structured_outputs": {"regex": reply}})
        r = server.client.chat.completions.create(**kw)
        message = r.choices[0].message
        assert message.content == "Checking.\n" and r.choices[0].finish_reason == "tool_calls"
        calls = as_dicts(message)
        check_calls(calls)
        content, streamed, finish = reassemble(server.client.chat.completions.create(**kw, stream=True))
        assert content == message.content and finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c["name"], c["arguments"]) for c in calls]
    plain = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                                  temperature=0, extra_body={"structured_outputs": {"regex": "[a-z]{5}"}})
    assert plain.choices[0].message.tool_calls is None and len(plain.choices[0].message.content) == 5


def test_the_template_gets_tools_calls_and_results(server) -> None:
    messages = [*MESSAGES,
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    text = server.engine.model_info.tokenizer.decode(tokens, skip_special_tokens=False)
    assert json.dumps(TOOLS[1], ensure_ascii=False) in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>' in text
    assert "<tool_response id=call_1>21 degrees</tool_response>" in text
    r = server.client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                              max_tokens=4, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, None),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tool_requests_are_400s(server, extra, param) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **extra})
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param


def test_auto_needs_a_parser(checkpoints) -> None:
    with live_server(str(checkpoints["qwen2"].path), MODEL, None) as (url, _):
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 3}
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "tool_choice": "auto"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        r = httpx.post(f"{url}/v1/chat/completions", json=body)  # no choice given: the text is content
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] is None


def test_the_openai_clients_stream_helper_reassembles_calls(server) -> None:
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=150,
                  temperature=1.0, seed=1)
        with server.client.chat.completions.stream(**kw) as stream:
            final = stream.get_final_completion()
        full = server.client.chat.completions.create(**kw)
        assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == \
            [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]
        assert final.choices[0].finish_reason == full.choices[0].finish_reason
