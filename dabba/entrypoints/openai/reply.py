"""One reply as every chat API reads it: its thinking (reasoning.py), its answer text and the tool
calls in the answer (tool_calls.py, tool_call_parsers.py), as events in the order the reply writes them. The chat
completions, Messages and Responses APIs each render these events in their own shapes; none of
them reads a reply itself."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dabba.entrypoints.openai.reasoning import ReasoningParser, make_reasoning_parser
from dabba.entrypoints.openai.tool_call_parsers import READS_SPECIAL_TOKENS, call_id_maker, make_extractor
from dabba.entrypoints.openai.tool_calls import Extracted, Extractor, NamedExtractor, ToolCall


@dataclass
class Thinking:
    text: str


@dataclass
class Text:
    text: str


@dataclass
class CallOpened:
    """Call ``index`` of the reply begins: its id and name are known."""

    index: int
    call: ToolCall


@dataclass
class CallArguments:
    """More of call ``index``'s arguments (JSON text; a call read whole brings them all at once)."""

    index: int
    text: str


Event = Thinking | Text | CallOpened | CallArguments


@dataclass
class Reply:
    """A whole reply: thinking (None: none), answer text (None: none) and calls."""

    reasoning: str | None = None
    content: str | None = None
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ReplyFormat:
    """How a request's replies are read: ``tool_choice`` "none", "auto", "required" or a named
    function ({"function": {"name": ...}}), with the server's ``tool_parser`` for "auto";
    ``reasoning_parser`` the server's (unused for a ``constrained`` reply, whose grammar holds from
    its first token: all answer); ``parallel_tool_calls`` False keeps the first call only;
    ``functions`` the tools' parameter schemas by name (a parser may type values by them)."""

    tool_choice: Any = "none"
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    constrained: bool = False
    parallel_tool_calls: bool = True
    functions: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False)  # parameters by name

    @property
    def keeps_special_tokens(self) -> bool:
        """The reply must be detokenized with its special tokens for the parser to see its marker."""
        return self.tool_choice == "auto" and self.tool_parser in READS_SPECIAL_TOKENS

    def reader(self) -> ReplyReader:
        return ReplyReader(self)


class ReplyReader:
    """Reads one reply as it streams: ``feed(delta, finished)`` returns the events the new text
    brings (text that may still turn out to be a tag or a call is held back until it is known);
    ``read(text)`` is the whole reply. Streamed events reassemble to the whole reply's reading."""

    def __init__(self, form: ReplyFormat) -> None:
        self.thinking: ReasoningParser | None = None if form.constrained else make_reasoning_parser(form.reasoning_parser)
        self.extractor: Extractor | None = make_extractor(form.tool_choice, form.tool_parser, form.functions)
        self.parallel = form.parallel_tool_calls
        self.new_call_id = call_id_maker(form.tool_parser)
        self.num_calls = 0

    @property
    def reads_calls(self) -> bool:
        return self.extractor is not None

    def feed(self, delta: str, finished: bool = False) -> list[Event]:
        events: list[Event] = []
        answer = delta
        if self.thinking is not None:
            split = self.thinking.feed(delta)
            if finished:
                rest = self.thinking.finish()
                split.reasoning, split.content = split.reasoning + rest.reasoning, split.content + rest.content
            if split.reasoning:
                events.append(Thinking(split.reasoning))
            answer = split.content
        if self.extractor is None:
            if answer:
                events.append(Text(answer))
            return events
        if isinstance(self.extractor, NamedExtractor):  # the call opens at once; the text is its arguments
            if self.num_calls == 0:
                self.num_calls = 1
                self.extractor.call.id = self.new_call_id()
                events.append(CallOpened(0, self.extractor.call))
            self.extractor.feed(answer)
            if answer:
                events.append(CallArguments(0, answer))
            return events
        news = self.extractor.feed(answer)
        if finished:
            rest = self.extractor.finish()
            news = Extracted(news.content + rest.content, news.calls + rest.calls)
        if news.content:
            events.append(Text(news.content))
        for call in news.calls:
            if self.num_calls and not self.parallel:
                break
            call.id = self.new_call_id()
            events += [CallOpened(self.num_calls, call), CallArguments(self.num_calls, call.arguments)]
            self.num_calls += 1
        return events

    def read(self, text: str) -> Reply:
        reply = Reply()
        calls: dict[int, ToolCall] = {}
        for event in self.feed(text, finished=True):
            if isinstance(event, Thinking):
                reply.reasoning = (reply.reasoning or "") + event.text
            elif isinstance(event, Text):
                reply.content = (reply.content or "") + event.text
            elif isinstance(event, CallOpened):
                calls[event.index] = event.call
        reply.calls = [calls[i] for i in sorted(calls)]
        return reply
