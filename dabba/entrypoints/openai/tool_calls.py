"""OpenAI tool calling: which calls a chat completion's text holds, streamed or not.

- ``tool_choice`` "required" or a named function: the output is constrained (structured outputs)
  to JSON built from the functions' parameter schemas, so even a weak model's calls validate:
  a named function's arguments object, or for "required" an array of {"name", "parameters"}.
- "auto": the model writes calls in its own syntax, read by the parser the server was started
  with (``--tool-call-parser``): ``hermes`` (Qwen 2.5/3, Hermes: ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` blocks after any content) or ``llama3_json`` (Llama 3.x: the
  whole reply is ``{"name": ..., "parameters": {...}}``, several joined by ";").

Each reading has a streaming form (``Extractor.feed``) that emits content and finished calls as
the text arrives and, at the end, exactly what the non-streamed reading of the whole text gives:
streamed deltas reassemble to the non-streamed message.
"""
from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("dabba")

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=tool_call_id)


@dataclass
class Extracted:
    """What a piece of text added: content to show, calls that finished."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def _call_of(obj: Any, arguments_key: str) -> ToolCall | None:
    """{"name": str, arguments_key: object} -> a call; anything else is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class Extractor:
    """Reads one choice's text as it grows. ``feed(delta)`` returns what can be shown now;
    ``finish()`` returns the rest. ``read(text)`` is the non-streamed reading."""

    def __init__(self) -> None:
        self.text = ""

    def feed(self, delta: str) -> Extracted:
        raise NotImplementedError

    def finish(self) -> Extracted:
        raise NotImplementedError

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls) of a whole reply, as the stream would deliver them."""
        first, last = self.feed(text), self.finish()
        content = first.content + last.content
        return content or None, first.calls + last.calls


class HermesExtractor(Extractor):
    """Content is the text before the first ``<tool_call>``; each block that closes (or the last,
    left open when the reply ends) holding {"name", "arguments"} is a call; a block that does not
    parse is dropped (logged); text after the first block is not content."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.content_sent = 0  # characters of the text before the first block already shown
        self.scanned = 0  # where the next block may start
        self.in_calls = False

    def _block(self, body: str) -> list[ToolCall]:
        try:
            call = _call_of(json.loads(body), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is None:
            logger.warning("hermes tool parser: dropped a block that is not a call: %r", body[:200])
            return []
        return [call]

    def feed(self, delta: str) -> Extracted:
        self.text += delta
        out = Extracted()
        if not self.in_calls:
            start = self.text.find(self.START)
            if start < 0:  # hold back what could be the start of the marker
                safe = len(self.text)
                for k in range(min(len(self.START) - 1, len(self.text)), 0, -1):
                    if self.START.startswith(self.text[-k:]):
                        safe = len(self.text) - k
                        break
                out.content, self.content_sent = self.text[self.content_sent:safe], safe
                return out
            out.content, self.content_sent = self.text[self.content_sent:start], start
            self.in_calls, self.scanned = True, start
        while True:
            start = self.text.find(self.START, self.scanned)
            end = self.text.find(self.END, start + len(self.START)) if start >= 0 else -1
            if end < 0:
                return out
            out.calls += self._block(self.text[start + len(self.START):end])
            self.scanned = end + len(self.END)

    def finish(self) -> Extracted:
        if not self.in_calls:  # no block: the held-back tail is content too
            out = Extracted(self.text[self.content_sent:])
            self.content_sent = len(self.text)
            return out
        start = self.text.find(self.START, self.scanned)
        if start < 0 or not self.text[start + len(self.START):].strip():
            return Extracted()
        self.scanned = len(self.text)
        return Extracted(calls=self._block(self.text[start + len(self.START):]))


class Llama3JsonExtractor(Extractor):
    """A reply that starts (after whitespace, or ``<|python_tag|>``) with "{" is calls: JSON
    objects {"name", "parameters"} joined by ";". If it does not parse, it is content after all.
    Other replies are content, streamed as they come."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.mode: str | None = None  # "content" or "calls", once the first characters tell
        self.sent = 0

    def feed(self, delta: str) -> Extracted:
        self.text += delta
        if self.mode is None:
            head = self.text.lstrip()
            if head.startswith("{") or head.startswith(self.TAG):
                self.mode = "calls"
            elif head and not self.TAG.startswith(head):
                self.mode = "content"
        if self.mode != "content":
            return Extracted()
        out = Extracted(self.text[self.sent:])
        self.sent = len(self.text)
        return out

    def finish(self) -> Extracted:
        if self.mode == "calls":
            calls = self._calls(self.text.lstrip().removeprefix(self.TAG))
            if calls:
                return Extracted(calls=calls)
        out = Extracted(self.text[self.sent:])
        self.sent = len(self.text)
        return out

    @staticmethod
    def _calls(text: str) -> list[ToolCall]:
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(text):
            while i < len(text) and (text[i].isspace() or text[i] == ";"):
                i += 1
            if i == len(text):
                break
            try:
                obj, i = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                return []
            call = _call_of(obj, "parameters" if isinstance(obj, dict) and "parameters" in obj else "arguments")
            if call is None:
                return []
            calls.append(call)
        return calls


class RequiredExtractor(Extractor):
    """tool_choice "required": the constrained reply is a JSON array of {"name", "parameters"};
    each element is a call as soon as it closes. Never content."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0  # where the next element (or the array's opening) starts
        self.decoder = json.JSONDecoder()

    def feed(self, delta: str) -> Extracted:
        self.text += delta
        out = Extracted()
        while True:
            i = self.pos
            while i < len(self.text) and (self.text[i].isspace() or self.text[i] in "[,"):
                i += 1
            if i >= len(self.text) or self.text[i] == "]":
                return out
            try:
                obj, end = self.decoder.raw_decode(self.text, i)
            except json.JSONDecodeError:
                return out  # the element is not complete yet
            call = _call_of(obj, "parameters")
            if call is not None:
                out.calls.append(call)
            self.pos = end

    def finish(self) -> Extracted:
        return Extracted()


class NamedExtractor(Extractor):
    """tool_choice naming a function: the constrained reply is that function's arguments object;
    the call (id and name) opens at once and the text streams as its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.call = ToolCall(name, "")

    def feed(self, delta: str) -> Extracted:
        self.text += delta
        self.call.arguments = self.text
        return Extracted()

    def finish(self) -> Extracted:
        return Extracted()

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        self.feed(text)
        return None, [self.call]


def make_extractor(tool_choice: Any, parser: str | None) -> Extractor | None:
    """None when the reply is plain content (no tools, tool_choice "none", or "auto" without a parser)."""
    if isinstance(tool_choice, dict):
        return NamedExtractor(tool_choice["function"]["name"])
    if tool_choice == "required":
        return RequiredExtractor()
    if tool_choice == "auto" and parser is not None:
        return {"hermes": HermesExtractor, "llama3_json": Llama3JsonExtractor}[parser]()
    return None


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """tool_choice "required": one or more calls (one if not ``parallel``) of the given functions,
    each's parameters valid against its schema."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [f["name"]]},
                             "parameters": f.get("parameters") or {"type": "object"}},
              "required": ["name", "parameters"]} for f in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object"}
