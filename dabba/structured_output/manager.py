"""Grammars and matchers for the requests that constrain their output (vLLM v1's
StructuredOutputManager, on xgrammar).

- ``submit`` (at add_request) validates the constraint, then compiles it in a small thread
  pool, off the engine loop; equal constraints share one compilation (cached by their key).
- The scheduler admits a request only once ``grammar_ready`` (its matcher then exists), so a
  compiling request waits in its own state while the rest of the batch runs.
- Each step ``grammar_bitmask`` fills one row per constrained request that samples (the
  tokens its grammar allows next), the worker applies the rows to those logits before any
  sampler feature, and ``accept_token`` advances the matcher on the token sampled.

Matchers live and advance on the engine thread only; the pool only compiles.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import numpy as np

from dabba.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

    from dabba.core.request import Request
    from dabba.engine.tokenizer import Tokenizer

logger = logging.getLogger("dabba")

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept for reuse (least recently used go first)


class StructuredOutputManager:
    def __init__(self, tokenizer: "Tokenizer", vocab_size: int, stop_token_ids: frozenset[int],
                 max_workers: int = 2) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="dabba-grammar")
        self._lock = threading.Lock()  # the grammar cache
        self._compiler_lock = threading.Lock()  # the compiler, built slowly once: never under _lock
        self._compiler: "xgr.GrammarCompiler | None" = None
        self._grammars: OrderedDict[tuple, Future] = OrderedDict()  # key -> Future[CompiledGrammar]
        self._matchers: dict[str, "xgr.GrammarMatcher"] = {}  # request id -> its matcher

    # ---- compilation (any thread) ---------------------------------------------------------
    def _get_compiler(self) -> "xgr.GrammarCompiler":
        """Built on first use: the tokenizer's vocabulary as xgrammar sees it."""
        import xgrammar as xgr

        from dabba.structured_output.grammar import tokenizer_info

        with self._compiler_lock:
            if self._compiler is None:
                tok = self.tokenizer.hf_tokenizer
                info = tokenizer_info(json.loads(tok.to_str()), tok.get_vocab(with_added_tokens=True),
                                      self.vocab_size, list(self.stop_token_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def submit(self, params: StructuredOutputsParams) -> Future:
        """Validate (ValueError naming the field) and start compiling, or find the compilation
        under way or done. Validation builds the grammar here, on the caller's thread: the
        server calls this off its event loop before it queues the request."""
        from dabba.structured_output.grammar import build_grammar

        key = params.key
        with self._lock:
            future = self._grammars.get(key)
            if future is not None:
                self._grammars.move_to_end(key)
                return future
        grammar = build_grammar(params)
        with self._lock:
            future = self._grammars.get(key)
            if future is None:
                future = self._grammars[key] = self._pool.submit(self._compile, grammar)
                while len(self._grammars) > MAX_CACHED_GRAMMARS:
                    self._grammars.popitem(last=False)
            return future

    def wait_for_grammars(self, timeout: float) -> None:
        """Until a compilation under way finishes, or ``timeout`` seconds."""
        with self._lock:
            pending = [f for f in self._grammars.values() if not f.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def _compile(self, grammar: "xgr.Grammar") -> "xgr.CompiledGrammar":
        return self._get_compiler().compile_grammar(grammar)

    # ---- the engine thread ----------------------------------------------------------------
    def grammar_ready(self, request: "Request") -> bool:
        """True once the request's grammar is compiled (its matcher is made then); raises
        ValueError if compiling failed."""
        if request.request_id in self._matchers:
            return True
        future = self.submit(request.sampling_params.structured_outputs)
        if not future.done():
            return False
        import xgrammar as xgr

        try:
            compiled = future.result()
        except Exception as e:
            raise ValueError(f"structured_outputs could not be compiled: {e}") from e
        self._matchers[request.request_id] = xgr.GrammarMatcher(compiled)
        return True

    def grammar_bitmask(self, request_ids: list[str]) -> np.ndarray | None:
        """[len(request_ids), ceil(vocab / 32)] int32: bit t of a row allows token t next."""
        if not request_ids:
            return None
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(request_ids), self.vocab_size)
        for row, request_id in enumerate(request_ids):
            self._matchers[request_id].fill_next_token_bitmask(bitmask, row)
        return bitmask.numpy()

    def accept_token(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher; True when its grammar has ended (the token was a stop
        token where the grammar may end). Raises ValueError on a token the grammar forbids."""
        matcher = self._matchers[request_id]
        if not matcher.accept_token(token_id):
            raise ValueError(f"token {token_id} is not allowed by the request's structured_outputs")
        return matcher.is_terminated()

    def free(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
