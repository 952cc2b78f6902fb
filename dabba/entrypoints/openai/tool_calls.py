"""OpenAI tool calling: which calls a chat completion's text holds, streamed or not. The calls,
the Extractor every reading is, and the forced choices' readings and schemas:

- ``tool_choice`` "required" or a named function: the output is constrained (structured outputs)
  to JSON built from the functions' parameter schemas, so even a weak model's calls validate:
  a named function's arguments object, or for "required" an array of {"name", "parameters"}.
- "auto": the model writes calls in its own syntax, read by the parser the server was started
  with (tool_call_parsers.py).

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


def call_of(obj: Any, arguments_key: str) -> ToolCall | None:
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


def partial_marker_at_end(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that ``marker`` could still grow from (held back)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


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
            call = call_of(obj, "parameters")
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
