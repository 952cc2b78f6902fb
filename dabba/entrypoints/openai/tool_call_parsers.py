"""The syntaxes models write tool calls in, read for tool_choice "auto" by the parser the server
was started with (``--tool-call-parser``): ``hermes`` (Qwen 2.5/3, Hermes: ``<tool_call>{"name":
..., "arguments": {...}}</tool_call>`` blocks after any content), ``llama3_json`` (Llama 3.x: the
whole reply is ``{"name": ..., "parameters": {...}}``, several joined by ";"), ``mistral``
(``[TOOL_CALLS]`` then a JSON array, or ``name[ARGS]{...}``; its marker is a special token, its
call ids 9 letters or digits), ``pythonic`` (Llama 3.2/4:
``[f(a=1), g(b="x")]``, literals only, never evaluated) or ``qwen3_coder`` (Qwen3-Coder's XML:
``<tool_call><function=f><parameter=a>1</parameter></function></tool_call>``). Each streams as
tool_calls.py's Extractor does: deltas reassemble to the whole reply's reading.
"""
from __future__ import annotations

import ast
import json
import logging
import re
import secrets
import string
from typing import Any, Callable

from dabba.entrypoints.openai.tool_calls import (Extracted, Extractor, NamedExtractor, RequiredExtractor, ToolCall,
                                                 call_of, partial_marker_at_end, tool_call_id)

logger = logging.getLogger("dabba")

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")
# Parsers whose marker the tokenizer holds as a special token (Mistral's [TOOL_CALLS]): the reply is
# detokenized with its special tokens, or the marker would never reach the parser (as vLLM does).
READS_SPECIAL_TOKENS = frozenset({"mistral"})


def mistral_call_id() -> str:
    """Mistral's templates raise on a call id that is not 9 letters or digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def call_id_maker(parser: str | None) -> Callable[[], str]:
    """How a server with this parser names the calls it returns (whatever reads them: a forced
    tool_choice's calls come back to the same template)."""
    return mistral_call_id if parser == "mistral" else tool_call_id


class TaggedBlocksExtractor(Extractor):
    """Content is the text before the first ``START``; each ``START``...``END`` block that closes
    (or the last, left open when the reply ends, if it holds anything) is read as calls
    (``_block``); text after the first block is not content."""

    START = END = ""

    def __init__(self) -> None:
        super().__init__()
        self.held = _Holdback(self.START)
        self.scanned = -1  # where the next block may start, once the first one did

    def feed(self, delta: str) -> Extracted:
        self.text += delta
        out = Extracted()
        if self.scanned < 0:
            out.content = self.held.content(self.text)
            start = self.text.find(self.START)
            if start < 0:
                return out
            self.scanned = start
        while True:
            start = self.text.find(self.START, self.scanned)
            end = self.text.find(self.END, start + len(self.START)) if start >= 0 else -1
            if end < 0:
                return out
            out.calls += self._block(self.text[start + len(self.START):end])
            self.scanned = end + len(self.END)

    def finish(self) -> Extracted:
        if self.scanned < 0:  # no block: the held-back tail is content too
            return Extracted(self.held.rest(self.text))
        start = self.text.find(self.START, self.scanned)
        self.scanned = len(self.text)
        if start < 0 or not self.text[start + len(self.START):].strip():
            return Extracted()
        return Extracted(calls=self._block(self.text[start + len(self.START):]))

    def _block(self, body: str) -> list[ToolCall]:
        raise NotImplementedError


class HermesExtractor(TaggedBlocksExtractor):
    """``<tool_call>`` blocks each holding {"name", "arguments"}; a block that does not parse is
    dropped (logged)."""

    START, END = "<tool_call>", "</tool_call>"

    def _block(self, body: str) -> list[ToolCall]:
        try:
            call = call_of(json.loads(body), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is None:
            logger.warning("hermes tool parser: dropped a block that is not a call: %r", body[:200])
            return []
        return [call]


class WholeReplyExtractor(Extractor):
    """A reply that opens (after whitespace) with ``OPENS`` or with the tag ``TAG`` is calls as a
    whole, read when it ends (``_read``); if they do not read, it is content after all. Other
    replies are content, streamed as they come."""

    OPENS = TAG = ""

    def __init__(self) -> None:
        super().__init__()
        self.mode: str | None = None  # "content" or "calls", once the first characters tell
        self.sent = 0

    def feed(self, delta: str) -> Extracted:
        self.text += delta
        if self.mode is None:
            head = self.text.lstrip()
            if head.startswith(self.OPENS) or head.startswith(self.TAG):
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
            calls = self._read(self.text)
            if calls:
                return Extracted(calls=calls)
        out = Extracted(self.text[self.sent:])
        self.sent = len(self.text)
        return out

    def _read(self, text: str) -> list[ToolCall] | None:
        raise NotImplementedError


class Llama3JsonExtractor(WholeReplyExtractor):
    """A reply that starts (after whitespace, or ``<|python_tag|>``) with "{" is calls: JSON
    objects {"name", "parameters"} joined by ";". If it does not parse, it is content after all.
    Other replies are content, streamed as they come."""

    OPENS, TAG = "{", "<|python_tag|>"

    def _read(self, text: str) -> list[ToolCall]:
        return self._calls(text.lstrip().removeprefix(self.TAG))

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
            call = call_of(obj, "parameters" if isinstance(obj, dict) and "parameters" in obj else "arguments")
            if call is None:
                return []
            calls.append(call)
        return calls


class MistralExtractor(Extractor):
    """Mistral's ``[TOOL_CALLS]``: content before the first marker; after it, a JSON array of
    {"name", "arguments"} (v0.3 tokenizers) or ``name[ARGS]{...}`` (v11 and later, one call per
    marker; ``name[CALL_ID]id[ARGS]{...}`` as Mistral Small 3.2's template writes its history).
    Calls are read when the reply ends; text that does not read as calls is content."""

    MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"

    def __init__(self) -> None:
        super().__init__()
        self.held = _Holdback(self.MARKER)

    def feed(self, delta: str) -> Extracted:
        self.text += delta
        return Extracted(self.held.content(self.text))

    def finish(self) -> Extracted:
        start = self.text.find(self.MARKER)
        if start < 0:
            return Extracted(self.held.rest(self.text))
        calls = self._calls(self.text[start:])
        if calls is None:  # not calls after all: the rest is content
            return Extracted(self.held.rest(self.text, force=True))
        return Extracted(calls=calls)

    def _calls(self, text: str) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        for part in text.split(self.MARKER)[1:]:
            part = part.strip()
            if not part:
                continue
            if part.startswith("["):  # [{"name": ..., "arguments": {...}}, ...]
                try:
                    items = json.loads(part)
                except json.JSONDecodeError:
                    return None
                found = [call_of(item, "arguments") for item in items] if isinstance(items, list) else [None]
            else:  # name[ARGS]{...}
                name, sep, args = part.partition(self.ARGS)
                name = name.partition(self.CALL_ID)[0]  # the id is the server's to give
                found = [call_of({"name": name.strip(), "arguments": args}, "arguments")] if sep else [None]
            if None in found:
                return None
            calls += found
        return calls or None


class PythonicExtractor(WholeReplyExtractor):
    """Llama 3.2 / 4's pythonic calls: a reply that is a Python list of calls with literal keyword
    arguments, ``[get_weather(city="Paris"), search(query="x", limit=2)]`` (Llama 4 may wrap it
    in ``<|python_start|>``...``<|python_end|>``). Read when the reply ends; a reply that does not
    start with "[" is content, streamed as it comes; one that does not parse is content too."""

    OPENS, TAG = "[", "<|python_start|>"
    END = "<|python_end|>"

    def _read(self, text: str) -> list[ToolCall] | None:
        return self._calls(text.strip().removeprefix(self.TAG).removesuffix(self.END).strip())

    @staticmethod
    def _calls(text: str) -> list[ToolCall] | None:
        try:
            tree = ast.parse(text, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if not isinstance(tree, ast.List):
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            arguments = {}
            for keyword in node.keywords:
                if keyword.arg is None:
                    return None
                try:
                    arguments[keyword.arg] = ast.literal_eval(keyword.value)
                except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                    return None
            try:
                calls.append(ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
            except (TypeError, ValueError):  # a literal JSON cannot hold (a set, bytes, a complex number)
                return None
        return calls


class Qwen3CoderExtractor(TaggedBlocksExtractor):
    """Qwen3-Coder's XML calls: content before the first ``<tool_call>``; each block
    ``<function=NAME><parameter=KEY>VALUE</parameter>...</function>`` is a call once it closes (or
    the last, left open when the reply ends). A value is text, read as JSON where its parameter's
    schema says it is not a string (integer, number, boolean, object, array, null)."""

    START, END = "<tool_call>", "</tool_call>"
    FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
    PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)

    def __init__(self, functions: dict[str, dict[str, Any]] | None = None) -> None:
        super().__init__()
        self.functions = functions or {}

    def _block(self, body: str) -> list[ToolCall]:
        match = self.FUNCTION.search(body)
        if match is None:
            logger.warning("qwen3_coder tool parser: dropped a block that is not a call: %r", body[:200])
            return []
        name = match.group(1).strip()
        schema = (self.functions.get(name) or {}).get("properties") or {}
        arguments = {key.strip(): _typed(value, schema.get(key.strip())) for key, value in
                     self.PARAMETER.findall(match.group(2))}
        return [ToolCall(name, json.dumps(arguments, ensure_ascii=False))]


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type: JSON where the schema says it is no string."""
    value = value.removeprefix("\n").removesuffix("\n")
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if kinds & {"integer", "number", "boolean", "object", "array", "null"} and "string" not in kinds:
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            pass
    return value


class _Holdback:
    """Content before a ``marker``, shown as it comes but for what may be the marker's start."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.sent = 0

    def content(self, text: str) -> str:
        start = text.find(self.marker)
        safe = start if start >= 0 else len(text) - partial_marker_at_end(text, self.marker)
        out, self.sent = text[self.sent:max(safe, self.sent)], max(safe, self.sent)
        return out

    def rest(self, text: str, force: bool = False) -> str:
        """The content not shown yet, at the end (``force``: all of it, the marker too)."""
        upto = len(text) if force or self.marker not in text else text.find(self.marker)
        out, self.sent = text[self.sent:upto], upto
        return out


def make_extractor(tool_choice: Any, parser: str | None,
                   functions: dict[str, dict[str, Any]] | None = None) -> Extractor | None:
    """None when the reply is plain content (no tools, tool_choice "none", or "auto" without a
    parser). ``functions``: each tool's parameters schema by name (qwen3_coder types its values)."""
    if isinstance(tool_choice, dict):
        return NamedExtractor(tool_choice["function"]["name"])
    if tool_choice == "required":
        return RequiredExtractor()
    if tool_choice == "auto" and parser is not None:
        if parser == "qwen3_coder":
            return Qwen3CoderExtractor(functions)
        return {"hermes": HermesExtractor, "llama3_json": Llama3JsonExtractor, "mistral": MistralExtractor,
                "pythonic": PythonicExtractor}[parser]()
    return None
