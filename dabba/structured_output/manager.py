"""Grammars and matchers for the requests that constrain their output (vLLM v1's
StructuredOutputManager, on xgrammar).

- ``compile`` (the Processor, on the caller's thread) claims the constraint's compilation in the
  process's compiler pool (compile_pool.py: worker processes, which build and check the grammar
  too, and which a deadline or a departed client can stop); equal constraints share one.
- The caller waits for it (an async front end up to its deadline) and releases its claim, so a
  request reaches the engine only with its grammar compiled, or is refused (InvalidRequest).
- On the engine thread, ``add_request`` makes each request's matcher; each step
  ``grammar_bitmask`` fills one row per constrained request that samples (the tokens its grammar
  allows next), the worker applies the rows to those logits before any sampler feature, and
  ``accept_token`` advances the matcher on the token sampled.

A row that allows nothing (a grammar with a dead end) allows one token instead, so sampling stays
well defined, and that token then ends the request with an error (GrammarDeadEnd) the client sees.
"""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dabba.structured_output.compile_pool import Compilation, Vocabulary, compiler_pool
from dabba.structured_output.params import StructuredOutputsParams, ThinkingSpan

if TYPE_CHECKING:
    import xgrammar as xgr

    from dabba.engine.tokenizer import Tokenizer

logger = logging.getLogger("dabba")

DEAD_END = ("structured_outputs reached a dead end: its grammar allows no token after the output so far and "
            "cannot end there")


class GrammarDeadEnd(ValueError):
    """The request's grammar allows no next token and cannot end (found as it generates)."""


@dataclass
class _Thinking:
    """Where a reply is with respect to its thinking: "start" (it may still open it), "inside"
    or "answer"; and the thinking's tokens so far."""

    span: ThinkingSpan
    where: str
    tokens: int = 0

    @property
    def spent(self) -> bool:
        return self.span.budget is not None and self.tokens >= self.span.budget


class StructuredOutputManager:
    def __init__(self, tokenizer: "Tokenizer", vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._vocabulary_lock = threading.Lock()  # built slowly, once
        self._vocabulary: Vocabulary | None = None
        self._matchers: dict[str, "xgr.GrammarMatcher"] = {}  # request id -> its matcher (engine thread)
        self._dead_ends: set[str] = set()  # requests whose last row allowed nothing
        self._thinking: dict[str, _Thinking] = {}  # requests that may think first

    # ---- compilation (any thread) ---------------------------------------------------------
    def _get_vocabulary(self) -> Vocabulary:
        """Built on first use: the tokenizer's vocabulary as xgrammar sees it."""
        from dabba.structured_output.grammar import tokenizer_info

        with self._vocabulary_lock:
            if self._vocabulary is None:
                tok = self.tokenizer.hf_tokenizer
                self._vocabulary = Vocabulary.of(tokenizer_info(
                    json.loads(tok.to_str()), tok.get_vocab(with_added_tokens=True), self.vocab_size,
                    list(self.stop_token_ids)))
            return self._vocabulary

    def compile(self, params: StructuredOutputsParams) -> Compilation:
        """Claim the constraint's compilation: the caller waits for ``.future`` (an InvalidRequest
        naming the field if it does not compile) and then calls release(). Raises Overloaded when
        the compilers' queue for a constraint of its size is full."""
        return compiler_pool().claim(self._get_vocabulary(), params)

    def release(self, compilation: Compilation) -> None:
        compiler_pool().release(compilation)

    # ---- the engine thread ----------------------------------------------------------------
    def add_request(self, request_id: str, compiled: "xgr.CompiledGrammar | None",
                    thinking: ThinkingSpan | None = None) -> None:
        """``compiled``: the request's grammar (None: a thinking budget alone). ``thinking``: the
        reply may think first, unconstrained, within its budget (a reasoning model's; see
        ThinkingSpan); the grammar holds the answer after it."""
        import xgrammar as xgr

        if compiled is not None:
            self._matchers[request_id] = xgr.GrammarMatcher(compiled)
        if thinking is not None:
            self._thinking[request_id] = _Thinking(thinking, "inside" if thinking.start is None else "start")

    def grammar_bitmask(self, request_ids: list[str]) -> np.ndarray | None:
        """[len(request_ids), ceil(vocab / 32)] int32: bit t of a row allows token t next. A row
        inside the thinking allows every token (only the closing tag once its budget is spent);
        one where the reply may still open its thinking allows the opening tag beside what the
        grammar allows."""
        if not request_ids:
            return None
        import xgrammar as xgr

        from dabba.structured_output.grammar import admits_no_token

        tensor = xgr.allocate_token_bitmask(len(request_ids), self.vocab_size)
        bitmask = tensor.numpy()  # the same memory
        words = bitmask.view(np.uint32)
        for row, request_id in enumerate(request_ids):
            thinking = self._thinking.get(request_id)
            matcher = self._matchers.get(request_id)
            if thinking is not None and thinking.where == "inside":
                if thinking.spent:
                    bitmask[row] = 0
                    words[row, thinking.span.end // 32] = np.uint32(1 << (thinking.span.end % 32))
                else:
                    bitmask[row] = -1  # every bit
                continue
            if matcher is None:  # a budget alone, past the thinking: anything
                bitmask[row] = -1
                continue
            matcher.fill_next_token_bitmask(tensor, row)
            if thinking is not None and thinking.where == "start":  # the opening tag too
                words[row, thinking.span.start // 32] |= np.uint32(1 << (thinking.span.start % 32))
            if admits_no_token(bitmask[row]):
                self._dead_ends.add(request_id)
                bitmask[row, 0] = 1  # token 0 alone, so that the row samples; accept_token ends the request
        return bitmask

    def accept_token(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher; True when its grammar has ended (the token was a stop
        token where the grammar may end). Raises GrammarDeadEnd after a row that allowed nothing,
        ValueError on a token the grammar forbids. Tokens of the thinking pass the grammar by."""
        if request_id in self._dead_ends:
            raise GrammarDeadEnd(DEAD_END)
        thinking = self._thinking.get(request_id)
        if thinking is not None:
            if thinking.where == "start" and token_id == thinking.span.start:
                thinking.where = "inside"
                return False
            if thinking.where == "inside":
                if token_id == thinking.span.end:
                    thinking.where = "answer"
                else:
                    thinking.tokens += 1
                return False
            thinking.where = "answer"  # the answer: the grammar holds from here
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        if not matcher.accept_token(token_id):
            raise ValueError(f"token {token_id} is not allowed by the request's structured_outputs")
        return matcher.is_terminated()

    def free(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._thinking.pop(request_id, None)
        self._dead_ends.discard(request_id)
