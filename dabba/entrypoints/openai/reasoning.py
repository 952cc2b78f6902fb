"""A reasoning model's thinking, split from its answer (``--reasoning-parser``), streamed or not.

Models that think write ``<think> ... </think>`` before the answer:

- ``qwen3``: the reply itself opens the block (Qwen3's hybrid template; with
  ``chat_template_kwargs={"enable_thinking": false}`` the template writes an empty block into the
  prompt and the reply is all answer). A reply that does not open with ``<think>`` is all answer.
- ``deepseek_r1``: the template opens the block in the prompt (DeepSeek-R1, QwQ, Qwen3's
  thinking-only models), so the reply starts inside it and only closes it; an opening tag the
  model writes anyway is dropped. A reply that never closes it is all thinking.

The thinking is stripped of the whitespace around it, the answer of the whitespace before it. The
streaming form (``feed``) holds back only what could still be part of a tag or trimmed whitespace,
so that the pieces streamed reassemble to exactly the whole reply's reading (``read``), wherever
the text was cut.
"""
from __future__ import annotations

from dataclasses import dataclass

from dabba.entrypoints.openai.tool_calls import partial_marker_at_end

START, END = "<think>", "</think>"


@dataclass
class Split:
    """What a piece of text added: thinking and answer to show."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Reads one reply as it grows: ``feed(delta)`` returns what can be shown now, ``finish()``
    the rest; ``read(text)`` is the reading of a whole reply. ``thinking`` says whether the reply
    is still inside its thinking (what follows is not the answer yet)."""

    def __init__(self, opens_in_prompt: bool) -> None:
        self.opens_in_prompt = opens_in_prompt
        self.text = ""
        self.state = "start"  # before the reply's first characters tell; "thinking"; "answer"
        self.pos = 0  # where the text not yet shown (nor dropped) starts
        self.started = {"thinking": False, "answer": False}  # whitespace before each is dropped

    @property
    def thinking(self) -> bool:
        return self.state == "thinking" or (self.state == "start" and self.opens_in_prompt)

    def feed(self, delta: str) -> Split:
        self.text += delta
        out = Split()
        if self.state == "start":
            head = self.text.lstrip()
            if head.startswith(START):
                self.state, self.pos = "thinking", len(self.text) - len(head) + len(START)
            elif not head or START.startswith(head):
                return out  # whitespace, or what may yet be the opening tag
            else:
                self.state = "thinking" if self.opens_in_prompt else "answer"
        if self.state == "thinking":
            end = self.text.find(END, self.pos)
            if end < 0:  # all but what may be the closing tag, and whitespace that may end the thinking
                out.reasoning = self._show("thinking", self._trimmed(len(self.text) - partial_marker_at_end(self.text, END)))
                return out
            out.reasoning = self._show("thinking", self._trimmed(end))
            self.state, self.pos = "answer", end + len(END)
        out.content = self._show("answer", len(self.text))
        return out

    def finish(self) -> Split:
        if self.state == "start":  # only whitespace, or the start of the opening tag
            if not self.text.strip():
                return Split()
            self.state = "thinking" if self.opens_in_prompt else "answer"
        if self.state == "thinking":  # the reply ended inside its thinking
            return Split(reasoning=self._show("thinking", self._trimmed(len(self.text))))
        return Split(content=self._show("answer", len(self.text)))

    def read(self, text: str) -> tuple[str | None, str | None]:
        """(thinking or None, answer or None) of a whole reply, as the stream delivers them."""
        first, last = self.feed(text), self.finish()
        return first.reasoning + last.reasoning or None, first.content + last.content or None

    def _trimmed(self, upto: int) -> int:
        """``upto`` moved back over whitespace (not before what was shown)."""
        return self.pos + len(self.text[self.pos:upto].rstrip())

    def _show(self, part: str, upto: int) -> str:
        piece, self.pos = self.text[self.pos:upto], max(self.pos, upto)
        if not self.started[part]:
            piece = piece.lstrip()
            self.started[part] = bool(piece)
        return piece


REASONING_PARSERS = {"qwen3": False, "deepseek_r1": True}  # name -> the block opens in the prompt


def make_reasoning_parser(name: str | None) -> ReasoningParser | None:
    return ReasoningParser(REASONING_PARSERS[name]) if name is not None else None
