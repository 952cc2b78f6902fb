"""The reasoning parsers (entrypoints/openai/reasoning.py) on hand-written replies, and the
property that matters for streaming: wherever a reply is cut into deltas, what the stream shows
reassembles to the whole reply's reading."""
from __future__ import annotations

import contextlib
import itertools
from types import SimpleNamespace

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dabba.entrypoints.openai.reasoning import REASONING_PARSERS, ReasoningParser, make_reasoning_parser
from tests.entrypoints.live_server import live_server
from tools.tiny_checkpoint import scripted_checkpoint


def streamed(parser: ReasoningParser, pieces: list[str]) -> tuple[str | None, str | None]:
    reasoning = content = ""
    for piece in pieces:
        split = parser.feed(piece)
        reasoning, content = reasoning + split.reasoning, content + split.content
    split = parser.finish()
    return reasoning + split.reasoning or None, content + split.content or None


def cut(text: str, positions: tuple[int, ...]) -> list[str]:
    bounds = [0, *positions, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("name, text, reasoning, content", [
    ("qwen3", "<think>\nFirst, 2 + 2.\n</think>\n\nIt is 4.", "First, 2 + 2.", "It is 4."),
    ("qwen3", "It is 4.", None, "It is 4."),  # enable_thinking=false: the prompt held the empty block
    ("qwen3", "<think>\n\n</think>\n\nIt is 4.", None, "It is 4."),
    ("qwen3", "<think>cut off by max_tokens", "cut off by max_tokens", None),
    ("qwen3", "says </think> in passing", None, "says </think> in passing"),  # no opening: all answer
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "  \n", None, None),
    ("deepseek_r1", "Let me see.\n</think>\n\nIt is 4.", "Let me see.", "It is 4."),
    ("deepseek_r1", "<think>Let me see.</think>It is 4.", "Let me see.", "It is 4."),  # an opening written anyway
    ("deepseek_r1", "never closes", "never closes", None),
    ("deepseek_r1", "</think>only the answer", None, "only the answer"),
    ("deepseek_r1", "a < b </thin", "a < b </thin", None),  # a partial tag at the end is thinking after all
])
def test_a_whole_reply_and_every_cut_of_it(name, text, reasoning, content) -> None:
    assert make_reasoning_parser(name).read(text) == (reasoning, content)
    for k in range(1, 3):  # every one and two cut positions
        for positions in itertools.combinations(range(1, len(text)), k):
            assert streamed(make_reasoning_parser(name), cut(text, positions)) == (reasoning, content), positions


def test_thinking_says_where_the_reply_is() -> None:
    qwen = make_reasoning_parser("qwen3")
    assert not qwen.thinking
    qwen.feed("<think>hm")
    assert qwen.thinking
    qwen.feed("</think>")
    assert not qwen.thinking
    r1 = make_reasoning_parser("deepseek_r1")
    assert r1.thinking  # the prompt opened the block
    r1.feed("x</think>")
    assert not r1.thinking
    assert make_reasoning_parser(None) is None


PIECES = st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "think", ">", "<", " ", "\n", "a", "bc",
                          "<think", "</think", "é", "x y"])


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=12), st.sampled_from(sorted(REASONING_PARSERS)), st.data())
def test_any_reply_cut_anywhere_streams_its_whole_reading(pieces, name, data) -> None:
    text = "".join(pieces)
    whole = make_reasoning_parser(name).read(text)
    for at in range(len(text) + 1):  # every single cut
        assert streamed(make_reasoning_parser(name), cut(text, (at,))) == whole
    positions = data.draw(st.lists(st.integers(0, len(text)), max_size=8).map(lambda xs: tuple(sorted(xs))))
    assert streamed(make_reasoning_parser(name), cut(text, positions)) == whole
    reasoning, content = whole
    assert reasoning is None or (reasoning in text and "</think>" not in reasoning)  # the thinking ends at the tag
    assert content is None or content in text


# ---- over HTTP: a scripted model (tools/tiny_checkpoint.scripted_checkpoint) that thinks on cue ----------------

THINKING = ["<think>", "First, 2 + 2.", "</think>", "\n\nIt is 4."]
CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# replies whose thinking holds a call (never read as one) and whose answer holds one (read)
CALL_IN_THINKING = ["<think>", "<tool_call>", CALL, "</tool_call>", "</think>", "No call."]
CALL_IN_ANSWER = ["<think>", "Weather, so a call.", "</think>", "<tool_call>", CALL, "</tool_call>"]
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


# the template shows an earlier turn's thinking and the enable_thinking switch (chat_template_kwargs)
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{% if m.reasoning_content %}[{{ m.reasoning_content }}]"
            "{% endif %}{{ m.content }}\n{% endfor %}{% if enable_thinking is false %}NOTHINK{% endif %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@contextlib.contextmanager
def scripted_server(tmp_path_factory, pieces: list[str], also: tuple[str, ...] = (), **options):
    path = scripted_checkpoint(tmp_path_factory.mktemp("scripted") / "model", pieces, also)
    with live_server(str(path), "scripted", None, **options) as (url, _):
        yield SimpleNamespace(url=url, client=openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0))


def streamed_message(stream) -> dict:
    """Chunks -> the parts a client reassembles: thinking, content, calls' names and arguments."""
    out = {"reasoning_content": "", "reasoning": "", "content": "", "calls": {}, "finish_reason": None}
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            for name in ("reasoning_content", "reasoning", "content"):
                out[name] += delta.get(name) or ""
            for call in delta.get("tool_calls") or []:
                entry = out["calls"].setdefault(call["index"], ["", ""])
                entry[0] += call["function"].get("name") or ""
                entry[1] += call["function"].get("arguments") or ""
            out["finish_reason"] = choice.finish_reason or out["finish_reason"]
    return out


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    with scripted_server(tmp_path_factory, THINKING, reasoning_parser="qwen3", chat_template=TEMPLATE) as server:
        yield server


def test_chat_completions_split_the_thinking_streamed_and_not(thinking_server) -> None:
    r = thinking_server.client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=20)
    message = r.choices[0].message
    assert message.content == "It is 4." and r.choices[0].finish_reason == "stop"
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == "First, 2 + 2."
    streamed = streamed_message(thinking_server.client.chat.completions.create(model="scripted", messages=MESSAGES,
                                                                        max_tokens=20, stream=True))
    assert streamed == {"reasoning_content": "First, 2 + 2.", "reasoning": "First, 2 + 2.", "content": "It is 4.",
                        "calls": {}, "finish_reason": "stop"}
    # cut inside the thinking (max_tokens): all thinking, no answer
    r = thinking_server.client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=2)
    assert r.choices[0].message.content is None and r.choices[0].message.model_extra["reasoning"] == "First, 2 + 2."
    assert r.choices[0].finish_reason == "length"


def test_include_reasoning_false_drops_the_thinking(thinking_server) -> None:
    kw = dict(model="scripted", messages=MESSAGES, max_tokens=20, extra_body={"include_reasoning": False})
    message = thinking_server.client.chat.completions.create(**kw).choices[0].message
    assert message.content == "It is 4." and message.model_extra["reasoning_content"] is None
    streamed = streamed_message(thinking_server.client.chat.completions.create(**kw, stream=True))
    assert streamed["content"] == "It is 4." and streamed["reasoning"] == ""


@pytest.mark.parametrize("parser, pieces, reasoning, content", [
    ("qwen3", ["<think>", "Thinking it over.", "</think>", "no"], "Thinking it over.", "no"),
    ("qwen3", ["no"], None, "no"),  # a reply that does not open its thinking: constrained from its first token
    ("deepseek_r1", ["Thinking it over.", "</think>", "yes"], "Thinking it over.", "yes"),
])
def test_a_constraint_holds_the_answer_after_the_thinking(tmp_path_factory, parser, pieces, reasoning,
                                                            content) -> None:
    """The grammar lets the thinking by (the tags are single tokens here, as in Qwen3's and
    DeepSeek-R1's vocabularies) and holds the answer: streamed and not, a choice and a named
    tool's arguments (in the spacing a forced call's grammar writes)."""
    tags = ("<think>", "</think>")  # in the vocabulary, whether the reply writes them or not
    with scripted_server(tmp_path_factory, pieces, tuple(t for t in tags if t not in pieces),
                         reasoning_parser=parser) as server:
        kw = dict(model="scripted", messages=MESSAGES, max_tokens=20)
        choice = {"structured_outputs": {"choice": ["yes", "no"]}}
        message = server.client.chat.completions.create(**kw, extra_body=choice).choices[0].message
        assert (message.model_extra["reasoning"], message.content) == (reasoning, content)
        streamed = streamed_message(server.client.chat.completions.create(**kw, extra_body=choice, stream=True))
        assert (streamed["reasoning"] or None, streamed["content"]) == (reasoning, content)
    call = '{"city": "Oslo"}'
    with scripted_server(tmp_path_factory, [*pieces[:-1], call], tuple(t for t in tags if t not in pieces),
                         reasoning_parser=parser) as server:
        r = server.client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=20, tools=TOOLS,
                                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
        message = r.choices[0].message
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("get_weather", call)]
        assert message.model_extra["reasoning"] == reasoning and r.choices[0].finish_reason == "tool_calls"


def test_a_thinking_budget_closes_the_thinking(tmp_path_factory) -> None:
    """max_thinking_tokens (Anthropic's thinking.budget_tokens maps to it): once the thinking has
    taken that many tokens, the closing tag is the only token allowed; the answer follows."""
    pieces = ["<think>", "Step one.", "Step two.", "Step three.", "</think>", "Done."]
    with scripted_server(tmp_path_factory, pieces, reasoning_parser="qwen3") as server:
        kw = dict(model="scripted", messages=MESSAGES, max_tokens=20)
        for budget, reasoning in ((None, "Step one.Step two.Step three."), (1, "Step one."), (2, "Step one.Step two."),
                                  (0, None)):
            extra = {} if budget is None else {"max_thinking_tokens": budget}
            message = server.client.chat.completions.create(**kw, extra_body=extra).choices[0].message
            assert (message.model_extra["reasoning"], message.content) == (reasoning, "Done."), budget
            streamed = streamed_message(server.client.chat.completions.create(**kw, extra_body=extra, stream=True))
            assert (streamed["reasoning"] or None, streamed["content"]) == (reasoning, "Done.")
        # with a constraint too: the budget, then the grammar holds the answer
        message = server.client.chat.completions.create(**kw, extra_body={
            "max_thinking_tokens": 1, "structured_outputs": {"choice": ["Done."]}}).choices[0].message
        assert (message.model_extra["reasoning"], message.content) == ("Step one.", "Done.")
        r = httpx.post(f"{server.url}/v1/chat/completions", json={**kw, "max_thinking_tokens": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_thinking_tokens"


def test_a_constraint_holds_the_whole_reply_where_the_tags_are_not_single_tokens(tmp_path_factory) -> None:
    """Without single-token tags the grammar cannot tell where the thinking ends: it holds the
    reply from its first token, which is then all answer."""
    with scripted_server(tmp_path_factory, ["Thinking.", "no"], reasoning_parser="deepseek_r1") as server:
        assert server.client.chat.completions.create(**dict(model="scripted", messages=MESSAGES, max_tokens=20),
                                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
                                                     ).choices[0].message.model_extra["reasoning"] is None


def rendered(server, **body) -> httpx.Response:
    """The prompt the server's template writes for ``body`` (/tokenize, then /detokenize)."""
    r = httpx.post(f"{server.url}/tokenize", json={"model": "scripted", **body})
    if r.status_code != 200:
        return r
    return httpx.post(f"{server.url}/detokenize", json={"model": "scripted", "tokens": r.json()["tokens"]})


def test_the_template_takes_the_thinking_and_chat_template_kwargs(thinking_server) -> None:
    """--chat-template replaces the checkpoint's; an earlier turn's reasoning_content reaches it
    (Qwen3's template keeps or drops it), and chat_template_kwargs its own variables."""
    turns = [*MESSAGES, {"role": "assistant", "content": "4", "reasoning_content": "adding"}, *MESSAGES]
    assert rendered(thinking_server, messages=turns).json()["prompt"] == (
        "<|user|>What is 2 + 2?\n<|assistant|>[adding]4\n<|user|>What is 2 + 2?\n<|assistant|>\n")
    off = rendered(thinking_server, messages=MESSAGES, chat_template_kwargs={"enable_thinking": False})
    assert off.json()["prompt"].endswith("NOTHINK<|assistant|>\n")
    r = thinking_server.client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=20,
                                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == "It is 4."
    # OpenAI's reasoning_effort "none" (also the Responses API's reasoning.effort) is the same switch
    off_count = httpx.post(f"{thinking_server.url}/tokenize", json={
        "messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}).json()["count"]
    on_count = httpx.post(f"{thinking_server.url}/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert off_count > on_count
    for effort, count in (("none", off_count), ("high", on_count)):
        r = thinking_server.client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=2,
                                                           reasoning_effort=effort)
        assert r.usage.prompt_tokens == count, effort
        response = thinking_server.client.responses.create(model="scripted", input=MESSAGES[0]["content"],
                                                           max_output_tokens=2, reasoning={"effort": effort})
        assert response.usage.input_tokens == count, effort
    for body in ({"chat_template_kwargs": {"messages": []}}, {"chat_template_kwargs": {"add_generation_prompt": 1}}):
        r = httpx.post(f"{thinking_server.url}/v1/chat/completions", json={"messages": MESSAGES, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    r = httpx.post(f"{thinking_server.url}/v1/chat/completions", json={"messages": MESSAGES,
                                                                       "chat_template_kwargs": ["x"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


@pytest.mark.parametrize("pieces, calls, content", [
    (CALL_IN_THINKING, {}, "No call."),
    (CALL_IN_ANSWER, {0: ["get_weather", '{"city": "Oslo"}']}, ""),
])
def test_tool_calls_are_read_from_the_answer_only(tmp_path_factory, pieces, calls, content) -> None:
    with scripted_server(tmp_path_factory, pieces, reasoning_parser="qwen3", tool_call_parser="hermes") as server:
        client = server.client
        kw = dict(model="scripted", messages=MESSAGES, tools=TOOLS, max_tokens=20)
        r = client.chat.completions.create(**kw)
        message = r.choices[0].message
        assert [[c.function.name, c.function.arguments] for c in message.tool_calls or []] == list(calls.values())
        assert (message.content or "") == content
        assert r.choices[0].finish_reason == ("tool_calls" if calls else "stop")
        assert message.model_extra["reasoning"] == ("<tool_call>" + CALL + "</tool_call>" if not calls
                                                    else "Weather, so a call.")
        streamed = streamed_message(client.chat.completions.create(**kw, stream=True))
        assert streamed["calls"] == calls and streamed["content"] == content
        assert streamed["reasoning"] == message.model_extra["reasoning"]
