"""A grammar compiler in a process of its own: ``python -m dabba.structured_output.compile_worker FD``.

xgrammar compiling an untrusted constraint may run for minutes and grow to gigabytes, and a
thread cannot be stopped; a process can be killed (compile_pool.py does, at a deadline or when
no request waits for its compile any more). It says ``("ready",)`` once it
has imported xgrammar; then commands come over the inherited pipe ``FD``, one at a time:

- ``("tokenizer", key, info_json)``: a vocabulary (xgrammar's TokenizerInfo, serialized) to
  compile for under ``key``;
- ``("compile", key, params)``: build the grammar of a constraint (StructuredOutputsParams) and
  compile it for the vocabulary ``key``; answered ``("ok", compiled_json)``, ``("invalid",
  message)`` (the constraint, refused as it was built) or ``("error", message)`` (xgrammar's
  refusal as it compiled).

The answer to a compile is checked first: a grammar that allows no first token admits no output
at all, and is an error the client sees rather than an empty answer.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from multiprocessing.connection import Connection

PARENT_CHECK_S = 1.0  # how often a worker looks whether its engine process is still there


def _exit_with_parent(parent: int) -> None:
    """A compile may outlast the engine that asked for it; the worker leaves with its parent
    (xgrammar releases the GIL while it compiles, so this thread runs meanwhile)."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(0)


def main(fd: int) -> None:
    import xgrammar as xgr

    from dabba.errors import InvalidRequest
    from dabba.structured_output.grammar import admits_no_token, build_grammar

    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    conn = Connection(fd)
    conn.send(("ready",))  # imported: what follows is compiling, which a deadline may bound
    compilers: dict[str, xgr.GrammarCompiler] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the engine closed the pipe
            return
        match message:
            case ("tokenizer", key, info_json):
                info = xgr.TokenizerInfo.deserialize_json(info_json)
                compilers[key] = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            case ("compile", key, params):
                try:
                    grammar = build_grammar(params)
                except InvalidRequest as e:
                    conn.send(("invalid", e.message))
                    continue
                try:
                    compiled = compilers[key].compile_grammar(grammar)
                    matcher = xgr.GrammarMatcher(compiled)
                    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
                    matcher.fill_next_token_bitmask(bitmask, 0)
                    if admits_no_token(bitmask.numpy()[0]):
                        conn.send(("error", "its grammar admits no output: no token may come first"))
                    else:
                        conn.send(("ok", compiled.serialize_json()))
                except Exception as e:  # xgrammar's refusal, in words (it is the client's constraint)
                    conn.send(("error", str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__))


if __name__ == "__main__":
    main(int(sys.argv[1]))
