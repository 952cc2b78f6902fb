"""The Responses API's output items as a reply's events (reply.py) build them: a reasoning item,
a message, function calls, and the stream's item events (output_item.added, content_part,
the deltas and their done, output_item.done)."""
from __future__ import annotations

import uuid
from typing import Any

from dabba.entrypoints.openai.reply import CallArguments, CallOpened, Text, Thinking


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class OutputItems:
    """The output items a reply's events build: a reasoning item, a message, function calls, each
    opened by the first event of its kind (a call always opens its own) and closed by the next."""

    def __init__(self) -> None:
        self.done: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.reasoning_text = ""
        self.has_answer = False

    def render(self, events: list) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, Thinking):
                self.reasoning_text += e.text
                out += self._ensure("reasoning", {"type": "reasoning", "id": item_id("rs"), "summary": [],
                                                  "content": [], "status": "in_progress"}, "reasoning_text")
                out.append(self._delta("response.reasoning_text.delta", e.text))
            elif isinstance(e, Text):
                self.has_answer = True
                out += self._ensure("message", {"type": "message", "id": item_id("msg"), "status": "in_progress",
                                                "role": "assistant", "content": []}, "output_text")
                out.append(self._delta("response.output_text.delta", e.text, logprobs=[]))
            elif isinstance(e, CallOpened):
                self.has_answer = True
                out += self.close()
                item = {"type": "function_call", "id": item_id("fc"), "call_id": e.call.id, "name": e.call.name,
                        "arguments": "", "status": "in_progress"}
                self.open = {"item": item, "index": len(self.done), "text": ""}
                out.append({"type": "response.output_item.added", "output_index": self.open["index"], "item": item})
            elif isinstance(e, CallArguments) and e.text:
                self.open["text"] += e.text
                out.append({"type": "response.function_call_arguments.delta", "item_id": self.open["item"]["id"],
                            "output_index": self.open["index"], "delta": e.text})
        return out

    def close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        item, index, text, part = self.open["item"], self.open["index"], self.open["text"], self.open.get("part")
        self.open = None
        out: list[dict[str, Any]] = []
        if item["type"] == "function_call":
            item = {**item, "arguments": text, "status": "completed"}
            out.append({"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                        "name": item["name"], "arguments": text})
        else:
            done_part = ({"type": "output_text", "text": text, "annotations": [], "logprobs": []} if part == "output_text"
                         else {"type": "reasoning_text", "text": text})
            kind = "response.output_text.done" if part == "output_text" else "response.reasoning_text.done"
            out.append({"type": kind, "item_id": item["id"], "output_index": index, "content_index": 0, "text": text,
                        **({"logprobs": []} if part == "output_text" else {})})
            out.append({"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "part": done_part})
            item = {**item, "content": [done_part], "status": "completed"}
        self.done.append(item)
        out.append({"type": "response.output_item.done", "output_index": index, "item": item})
        return out

    def output(self) -> list[dict[str, Any]]:
        return list(self.done)

    def as_message(self) -> dict[str, Any]:
        """The output as the assistant's chat message, for a continuation's conversation."""
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.done:
            if item["type"] == "reasoning":
                message["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                message["content"] += item["content"][0]["text"]
            else:
                message.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                    "name": item["name"], "arguments": item["arguments"]}})
        return message

    def _ensure(self, kind: str, item: dict[str, Any], part: str) -> list[dict[str, Any]]:
        if self.open is not None and self.open["item"]["type"] == kind:
            return []
        out = self.close()
        self.open = {"item": item, "index": len(self.done), "text": "", "part": part}
        empty = {"type": part, "text": ""} | ({"annotations": [], "logprobs": []} if part == "output_text" else {})
        return out + [{"type": "response.output_item.added", "output_index": self.open["index"], "item": item},
                      {"type": "response.content_part.added", "item_id": item["id"], "output_index": self.open["index"],
                       "content_index": 0, "part": empty}]

    def _delta(self, kind: str, text: str, **extra: Any) -> dict[str, Any]:
        self.open["text"] += text
        return {"type": kind, "item_id": self.open["item"]["id"], "output_index": self.open["index"],
                "content_index": 0, "delta": text, **extra}
