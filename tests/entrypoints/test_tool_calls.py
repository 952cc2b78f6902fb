"""Tool calling: the parsers on hand-written replies (streamed in pieces = read whole), and over
HTTP a random-weight model whose calls validate because tool_choice constrains them, "auto"
read by the hermes parser, streamed deltas that reassemble to the non-streamed message, the chat
template fed tools and tool messages, and 400s for bad tool requests."""
from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
from types import SimpleNamespace
from typing import Iterator

import httpx
import jsonschema
import openai
import pytest

from dabba.entrypoints.openai.tool_call_parsers import (HermesExtractor, Llama3JsonExtractor, MistralExtractor,
                                                        PythonicExtractor, Qwen3CoderExtractor)
from dabba.entrypoints.openai.reply import ReplyFormat
from dabba.entrypoints.openai.tool_calls import NamedExtractor, RequiredExtractor, required_schema

from tests.entrypoints.live_server import live_server
from tools.tiny_checkpoint import scripted_checkpoint

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


def split_feed(extractor, text: str, seed: int, pieces: list[str] | None = None):
    """Feed ``text`` in random pieces (or these ``pieces``); returns (content, calls) as a stream
    delivers them."""
    rng = random.Random(seed)
    if pieces is None:
        pieces, i = [], 0
        while i < len(text):
            j = min(len(text), i + rng.randint(1, 7))
            pieces.append(text[i:j])
            i = j
    content, calls = "", []
    for piece in pieces:
        news = extractor.feed(piece)
        content, calls = content + news.content, calls + news.calls
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


def every_cut(extractor_type, text: str, **options) -> tuple[str | None, list]:
    """The reading of ``text`` fed whole, checked equal to its reading cut at every position."""
    whole = split_feed(extractor_type(**options), text, 0, pieces=[text])
    for at in range(1, len(text)):
        assert split_feed(extractor_type(**options), text, 0, pieces=[text[:at], text[at:]]) == whole, at
    for seed in range(3):
        assert split_feed(extractor_type(**options), text, seed) == whole
    return whole


CALL_ARGS = '{"city": "Paris", "unit": "c"}'


@pytest.mark.parametrize("text, content, calls", [
    ("Just text.", "Just text.", []),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": ' + CALL_ARGS + '}, {"name": "search", "arguments": '
     '{"query": "x"}}]', None, [("get_weather", {"city": "Paris", "unit": "c"}), ("search", {"query": "x"})]),
    ("Let me look.[TOOL_CALLS]get_weather[ARGS]" + CALL_ARGS + '[TOOL_CALLS]search[ARGS]{"query": "x"}',
     "Let me look.", [("get_weather", {"city": "Paris", "unit": "c"}), ("search", {"query": "x"})]),
    ("[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]" + CALL_ARGS, None,  # as Small 3.2's template writes it
     [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("[TOOL_CALLS]not calls", "[TOOL_CALLS]not calls", []),  # not calls after all: content
    ("a [TOOL_CA", "a [TOOL_CA", []),
])
def test_mistral(text, content, calls) -> None:
    assert every_cut(MistralExtractor, text) == (content, calls)


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "search"}}])
def test_a_mistral_server_names_its_calls_as_mistral_templates_require(tool_choice) -> None:
    """Mistral's templates raise on a call id that is not 9 letters or digits, and the ids come back
    to the template in the next turn, whichever reading made the call."""
    ids = {}
    for parser, own in (("mistral", "[TOOL_CALLS]search[ARGS]{}"), ("hermes", '<tool_call>{"name": "search"}</tool_call>')):
        text = {"auto": own, "required": '[{"name": "search", "parameters": {}}]'}.get(str(tool_choice), "{}")
        (call,) = ReplyFormat(tool_choice, parser).reader().read(text).calls
        ids[parser] = call.id
    assert re.fullmatch("[A-Za-z0-9]{9}", ids["mistral"]) and ids["hermes"].startswith("call_")
    assert ReplyFormat(tool_choice, "mistral").keeps_special_tokens == (tool_choice == "auto")


@pytest.mark.parametrize("text, content, calls", [
    ('[get_weather(city="Paris", unit="c"), search(query="x", limit=2)]', None,
     [("get_weather", {"city": "Paris", "unit": "c"}), ("search", {"query": "x", "limit": 2})]),
    ('<|python_start|>[f(a=[1, {"b": None}], c=True)]<|python_end|>', None, [("f", {"a": [1, {"b": None}], "c": True})]),
    ("The answer is [1, 2].", "The answer is [1, 2].", []),
    ("[1, 2]", "[1, 2]", []),  # a list, not calls
    ("[f(1)]", "[f(1)]", []),  # a positional argument: not a call of this form
    ("[f(x=open('/etc/passwd'))]", "[f(x=open('/etc/passwd'))]", []),  # never evaluated: only literals
    ("[f(x={1, 2})]", "[f(x={1, 2})]", []),  # a literal JSON cannot hold
])
def test_pythonic(text, content, calls) -> None:
    assert every_cut(PythonicExtractor, text) == (content, calls)


QWEN3_CODER = ("<tool_call>\n<function=search>\n<parameter=query>\nrain & snow\n</parameter>\n<parameter=limit>\n3\n"
               "</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("text, content, calls", [
    ("I will search.\n" + QWEN3_CODER, "I will search.\n", [("search", {"query": "rain & snow", "limit": 3})]),
    (QWEN3_CODER + "\n" + QWEN3_CODER.replace("rain & snow", 'say "hi"\\n'), None,
     [("search", {"query": "rain & snow", "limit": 3}), ("search", {"query": 'say "hi"\\n', "limit": 3})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=unit>\nc", None,
     [("get_weather", {"city": "Oslo", "unit": "c"})]),  # cut off by max_tokens: the last block still read
    ("<tool_call>no function here</tool_call>", None, []),
    ("a <tool", "a <tool", []),
])
def test_qwen3_coder(text, content, calls) -> None:
    functions = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert every_cut(Qwen3CoderExtractor, text, functions=functions) == (content, calls)


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


# Each parser on a scripted model (tools/tiny_checkpoint.scripted_checkpoint) that writes its calls
# in that syntax, through the server, streamed and not ("required" and named calls are the
# constraint's, the same whatever the parser: test_forced_tool_choice_validates_streamed_and_not).
OSLO = {"city": "Oslo", "unit": "c"}
SCRIPTED_CALLS = {
    "hermes": ["Checking.", "<tool_call>", json.dumps({"name": "get_weather", "arguments": OSLO}), "</tool_call>"],
    "llama3_json": [json.dumps({"name": "get_weather", "parameters": OSLO})],
    "mistral": ["[TOOL_CALLS]", json.dumps([{"name": "get_weather", "arguments": OSLO}])],
    "pythonic": ['[get_weather(city="Oslo", unit="c")]'],
    "qwen3_coder": ["Checking.", "<tool_call>", "\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                    "<parameter=unit>\nc\n</parameter>\n</function>\n", "</tool_call>"],
}


@pytest.mark.parametrize("parser", sorted(SCRIPTED_CALLS))
def test_each_parser_reads_its_models_calls_through_the_server(parser, tmp_path_factory) -> None:
    path = scripted_checkpoint(tmp_path_factory.mktemp(parser) / "model", SCRIPTED_CALLS[parser])
    with live_server(str(path), MODEL, None, tool_call_parser=parser) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=20)
        r = client.chat.completions.create(**kw)
        message = r.choices[0].message
        assert [(c["name"], json.loads(c["arguments"])) for c in as_dicts(message)] == [("get_weather", OSLO)]
        assert r.choices[0].finish_reason == "tool_calls"
        assert message.content == ("Checking." if SCRIPTED_CALLS[parser][0] == "Checking." else None)
        content, streamed, finish = reassemble(client.chat.completions.create(**kw, stream=True))
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c["name"], c["arguments"]) for c in
                                                                   as_dicts(message)]
        assert content == message.content and finish == "tool_calls"
        none = client.chat.completions.create(**kw, tool_choice="none")  # the same reply is content then
        assert none.choices[0].message.tool_calls is None
        assert none.choices[0].message.content == "".join(SCRIPTED_CALLS[parser])
