"""The model families' own chat templates, as llama.cpp keeps them for its tests (models/templates
in its source tree, which scripts/peer-llamacpp.sh unpacks into .peers/llama.cpp; CI fails where
it is missing, a developer's run skips). No package on PyPI holds Gemma 3's; Gemma 2's and 4's
stand in for it.

- dabba renders each as transformers does, on conversations with a system turn, tools, a tool
  call and its result and earlier thinking (and refuses what the template refuses);
- a scripted model (tools/tiny_checkpoint.scripted_checkpoint) whose tokenizer has the family's
  special tokens as special tokens writes the family's tool-call (and thinking) syntax through
  the server: its parser reads the call, the client sends it back with its result, and the
  template renders that turn as transformers renders it."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import jinja2
import openai
import pytest

from dabba.engine.tokenizer import Tokenizer

from tests.entrypoints.live_server import live_server
from tools.tiny_checkpoint import save_byte_level_tokenizer, scripted_checkpoint

TEMPLATES = Path(__file__).resolve().parents[2] / ".peers" / "llama.cpp" / "models" / "templates"
MODEL = "tiny"


@pytest.fixture(scope="module")
def templates() -> Path:
    if not TEMPLATES.is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"{TEMPLATES} is missing: run scripts/peer-llamacpp.sh")
        pytest.skip("llama.cpp's source tree is not unpacked (scripts/peer-llamacpp.sh)")
    return TEMPLATES


CITY = {"city": "Oslo"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


# ---- rendering: dabba's jinja environment against transformers' ---------------------------------

CALL = {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": CITY}}
CONVERSATIONS = {
    "user": ([{"role": "user", "content": "Hi"}], {}),
    "system": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], {}),
    "turns": ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
               {"role": "user", "content": "Bye"}], {}),
    "tools": (ASK, {"tools": TOOLS}),
    "tool loop": ([*ASK, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": CALL["id"], "content": "-3 C"}], {"tools": TOOLS}),
    "thinking": ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello.", "reasoning_content": "A greeting."},
                  {"role": "user", "content": "Bye"}], {"enable_thinking": False}),
}
RENDERED = ["Qwen-Qwen3-0.6B.jinja", "Qwen3-Coder.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja",
            "meta-llama-Llama-3.2-3B-Instruct.jinja", "mistralai-Mistral-Nemo-Instruct-2407.jinja",
            "Mistral-Small-3.2-24B-Instruct-2506.jinja", "google-gemma-2-2b-it.jinja", "google-gemma-4-31B-it.jinja"]


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    save_byte_level_tokenizer(path, 1024, "docstrings")
    return path


@pytest.mark.parametrize("name", RENDERED)
def test_renders_as_transformers_does(templates, plain_tokenizer, name) -> None:
    from transformers import AutoTokenizer

    text = (templates / name).read_text()
    ours, theirs = Tokenizer(plain_tokenizer, chat_template=text), AutoTokenizer.from_pretrained(plain_tokenizer)
    theirs.chat_template = text
    refused = 0
    for messages, kwargs in CONVERSATIONS.values():
        for generation_prompt in (True, False):
            try:
                expected = theirs.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                      tokenize=False, **kwargs)
            except jinja2.TemplateError as e:  # the template's raise_exception (Gemma 2: no system turn)
                refused += 1
                with pytest.raises(jinja2.TemplateError, match=str(e)[:40]):
                    ours.apply_chat_template(messages, add_generation_prompt=generation_prompt, **kwargs)
                continue
            assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt, **kwargs) == expected
    assert refused == (4 if name == "google-gemma-2-2b-it.jinja" else 0)  # its system turn and tool loop


# ---- the families through the server ---------------------------------------------------------------

QWEN = ("<|im_start|>", "<|im_end|>")
QWEN_TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
LLAMA3 = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>")
MISTRAL = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
           "[/TOOL_RESULTS]")
MISTRAL_V11 = (*MISTRAL, "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[ARGS]", "[CALL_ID]")


@dataclass(frozen=True)
class Family:
    """A model family as its tokenizer, template and tool syntax have it: ``specials`` its special
    tokens (``eos`` ends a turn), ``also`` tokens its tokenizer has that are not special (Qwen's
    tags), ``reply`` what the scripted model writes: a call to get_weather(city="Oslo") in the
    family's syntax, read by ``parser``, after thinking ``thinking`` if any."""

    template: str
    specials: tuple[str, ...]
    eos: str
    reply: tuple[str, ...]
    parser: str
    bos: str | None = None
    also: tuple[str, ...] = ()
    reasoning_parser: str | None = None
    thinking: str | None = None


FAMILIES = {
    "qwen3": Family("Qwen-Qwen3-0.6B.jinja", QWEN, "<|im_end|>",
                    ("<think>", "\nThe weather: a call.\n", "</think>", "\n\n", "<tool_call>",
                     '\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n', "</tool_call>"),
                    "hermes", also=QWEN_TAGS, reasoning_parser="qwen3", thinking="The weather: a call."),
    "qwen3-coder": Family("Qwen3-Coder.jinja", QWEN, "<|im_end|>",
                          ("<tool_call>", "\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n",
                           "</tool_call>"), "qwen3_coder", also=QWEN_TAGS),
    "llama-3.1": Family("meta-llama-Llama-3.1-8B-Instruct.jinja", LLAMA3, "<|eot_id|>",
                        ('{"name": "get_weather", "parameters": {"city": "Oslo"}}',), "llama3_json",
                        bos="<|begin_of_text|>"),
    "llama-3.2": Family("meta-llama-Llama-3.2-3B-Instruct.jinja", LLAMA3, "<|eot_id|>",
                        ('[get_weather(city="Oslo")]',), "pythonic", bos="<|begin_of_text|>"),
    "mistral-nemo": Family("mistralai-Mistral-Nemo-Instruct-2407.jinja", (*MISTRAL, "<s>", "</s>"), "</s>",
                           ("[TOOL_CALLS]", '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'), "mistral",
                           bos="<s>"),
    "mistral-small-3.2": Family("Mistral-Small-3.2-24B-Instruct-2506.jinja", (*MISTRAL_V11, "<s>", "</s>"), "</s>",
                                ("[TOOL_CALLS]", "get_weather", "[ARGS]", '{"city": "Oslo"}'), "mistral", bos="<s>"),
}


def as_template_takes_it(message: dict) -> dict:
    """An assistant message as the API returned it, as a transformers user hands it to the
    template: its calls' arguments as objects (keys in the order the client sent them), its
    thinking as reasoning_content (vLLM's "reasoning" is the same text)."""
    out = {k: v for k, v in message.items() if k != "reasoning"}
    out["content"] = out.get("content") or ""
    if message.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {k: json.loads(v) if k == "arguments" else v
                                                for k, v in c["function"].items()}} for c in message["tool_calls"]]
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_tool_loop_in_the_familys_own_syntax(templates, family, tmp_path_factory) -> None:
    from transformers import AutoTokenizer

    f = FAMILIES[family]
    path = scripted_checkpoint(tmp_path_factory.mktemp(family) / "model", list(f.reply), f.also, specials=f.specials,
                               bos=f.bos, eos=f.eos, max_position_embeddings=2048)  # Mistral's default system prompt
    (path / "chat_template.jinja").write_text((templates / f.template).read_text())
    with live_server(str(path), MODEL, None, tool_call_parser=f.parser, reasoning_parser=f.reasoning_parser) \
            as (url, engine):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=40)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
            [("get_weather", CITY)]
        assert not (message.content or "").strip()
        assert message.reasoning_content == f.thinking
        # the client sends the call back with its result: the template takes the call's id and form
        said = message.model_dump(exclude_none=True)
        result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "-3 C"}
        turn = [*ASK, said, result]
        tokens = httpx.post(f"{url}/tokenize", json={"messages": turn, "tools": TOOLS}).raise_for_status().json()["tokens"]
        theirs = AutoTokenizer.from_pretrained(path)
        expected = theirs.apply_chat_template([*ASK, as_template_takes_it(said), result], tools=TOOLS,
                                              add_generation_prompt=True, tokenize=False)
        assert engine.model_info.tokenizer.decode(tokens, skip_special_tokens=False) == expected
        again = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, tool_choice="none",
                                               max_tokens=40)
        assert again.choices[0].finish_reason == "stop" and again.choices[0].message.tool_calls is None
        if f.reasoning_parser is None:
            # the call's text as content, less its special tokens (skip_special_tokens, as the call is not read)
            assert again.choices[0].message.content == "".join(p for p in f.reply if p not in f.specials)
        if family == "qwen3":  # the Messages API's loop on the same template: thinking, tool_use, tool_result
            messages_api_loop(url)


def messages_api_loop(url: str) -> None:
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    first = client.messages.create(model=MODEL, max_tokens=40, tools=tools, messages=ASK)
    assert [b.type for b in first.content] == ["thinking", "tool_use"] and first.stop_reason == "tool_use"
    use = first.content[1]
    assert (use.name, use.input) == ("get_weather", CITY)
    second = client.messages.create(model=MODEL, max_tokens=40, tools=tools, tool_choice={"type": "none"}, messages=[
        *ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "-3 C"}]}])
    assert second.stop_reason == "end_turn" and second.content[0].type == "thinking"


def test_gemma_2_refuses_a_system_turn_as_its_template_does(templates, tmp_path_factory) -> None:
    path = scripted_checkpoint(tmp_path_factory.mktemp("gemma") / "model", ["Hello", " there."],
                               specials=("<bos>", "<start_of_turn>", "<end_of_turn>"), bos="<bos>", eos="<end_of_turn>")
    (path / "chat_template.jinja").write_text((templates / "google-gemma-2-2b-it.jinja").read_text())
    with live_server(str(path), MODEL, None) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
        assert r.choices[0].message.content == "Hello there." and r.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError, match="System role not supported"):
            client.chat.completions.create(model=MODEL, max_tokens=8, messages=[
                {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
