"""Where constraints compile: worker processes (compile_worker.py) that can be killed, in two
lanes so that no request can take structured outputs away from the others.

- A constraint's compile is shared by every request that asks for it while it is queued or
  running (a ``Compilation``, keyed by vocabulary and constraint); a request that stops waiting
  (its deadline passed, its client left) releases its claim, and a compile nobody claims any
  more is dropped from its queue or, running, stopped by killing its worker.
- Small constraints and large ones (by the bytes of their text) queue in separate lanes, each
  with one worker and a bounded queue: large ones cannot hold up small ones, and a full queue
  refuses at once rather than letting requests pile up behind it.
- Only what compiled is cached (the least recently used go first); a failure is not kept.

One pool serves every engine of the process (data-parallel replicas share their compiles);
workers start when their lane first has work, and leave with the process.
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import os
import subprocess
import sys
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from dabba.errors import InvalidRequest, Overloaded

if TYPE_CHECKING:
    import xgrammar as xgr

    from dabba.structured_output.params import StructuredOutputsParams

logger = logging.getLogger("dabba")

SMALL_CONSTRAINT_BYTES = 8 * 2**10  # a constraint's text up to this size compiles in the small lane
MAX_QUEUED_PER_LANE = 64  # compiles waiting for a lane's worker; one more is refused (Overloaded)
MAX_CACHED_GRAMMARS = 256  # compiled grammars kept for reuse
POLL_S = 0.05  # how often a lane looks whether its running compile is still wanted
WORKER_START_TIMEOUT_S = 120.0  # a worker that has not imported xgrammar by then is broken


class CompileCancelled(Exception):
    """Every request that waited for a compile left; nobody reads this."""


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer as xgrammar sees it; ``key`` names it to the workers (equal vocabularies,
    such as data-parallel replicas', share one key and one compiler per worker)."""

    info: "xgr.TokenizerInfo"
    info_json: str
    key: str

    @classmethod
    def of(cls, info: "xgr.TokenizerInfo") -> "Vocabulary":
        info_json = info.serialize_json()
        return cls(info, info_json, hashlib.sha256(info_json.encode()).hexdigest()[:16])


@dataclass(eq=False)
class Compilation:
    """One constraint compiling for one vocabulary; ``future`` gets its xgrammar CompiledGrammar,
    or an InvalidRequest saying why it has none."""

    key: tuple
    vocabulary: Vocabulary | None  # None: found compiled in the cache
    params: "StructuredOutputsParams | None"
    lane: "Lane | None"
    future: Future = field(default_factory=Future)
    claims: int = 0  # requests waiting for it


class Lane:
    """One worker process and the compiles queued for it, run one at a time by the lane's thread."""

    def __init__(self, pool: "CompilerPool", name: str) -> None:
        self.pool, self.name = pool, name
        self.queue: deque[Compilation] = deque()
        self.running: Compilation | None = None
        self.worker: _Worker | None = None
        self.thread: threading.Thread | None = None
        self._start_lock = threading.Lock()  # one worker starts at a time

    def ensure_worker(self) -> "_Worker":
        """The lane's worker, started (and its import awaited) if it has none: a claim does this
        on the requester's thread, so that a request's deadline counts compiling, not starting."""
        with self._start_lock:
            if self.worker is None or not self.worker.alive():
                self.worker = _Worker.start()
            return self.worker

    # under pool.lock
    def push(self, compilation: Compilation) -> None:
        if len(self.queue) >= MAX_QUEUED_PER_LANE:
            raise Overloaded(f"{MAX_QUEUED_PER_LANE} constraints are already waiting to compile; retry later")
        self.queue.append(compilation)
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=f"dabba-grammar-{self.name}", daemon=True)
            self.thread.start()
        self.pool.changed.notify_all()

    def _run(self) -> None:
        pool = self.pool
        while True:
            with pool.lock:
                while not self.queue:
                    pool.changed.wait()
                compilation = self.running = self.queue.popleft()
            try:
                outcome = self._compile(compilation)
            except Exception as e:  # a bug here must not stop the lane: the request sees an error
                logger.exception("grammar compile failed")
                outcome = InvalidRequest("structured_outputs", f"structured_outputs could not be compiled: {e}")
            with pool.lock:
                self.running = None
                pool.finish(compilation, outcome)

    def _compile(self, compilation: Compilation) -> Any:
        """The compiled grammar, or the exception its requests get."""
        import xgrammar as xgr

        worker = self.ensure_worker()
        vocabulary = compilation.vocabulary
        try:
            if vocabulary.key not in worker.vocabularies:
                worker.conn.send(("tokenizer", vocabulary.key, vocabulary.info_json))
                worker.vocabularies.add(vocabulary.key)
            worker.conn.send(("compile", vocabulary.key, compilation.params))
            while not worker.conn.poll(POLL_S):
                if self.pool.drop_unclaimed(compilation):
                    self._stop_worker()
                    return CompileCancelled()
                if not worker.alive():
                    break
            status, value = worker.conn.recv()
        except (EOFError, OSError):  # killed (out of memory, say) while compiling this constraint
            code = worker.process.wait()
            self._stop_worker()
            return InvalidRequest("structured_outputs", "structured_outputs could not be compiled: the compiler "
                                  f"process exited (exit code {code}) while compiling it")
        if status == "invalid":  # refused as it was built: the message names what is wrong
            return InvalidRequest("structured_outputs", value)
        if status == "error":
            return InvalidRequest("structured_outputs", f"structured_outputs is invalid: {value}")
        return xgr.CompiledGrammar.deserialize_json(value, vocabulary.info)

    def _stop_worker(self) -> None:
        with self._start_lock:
            if self.worker is not None:
                self.worker.kill()
                self.worker = None


class CompilerPool:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.lanes = {"small": Lane(self, "small"), "large": Lane(self, "large")}
        self._compiling: dict[tuple, Compilation] = {}
        self._cache: OrderedDict[tuple, "xgr.CompiledGrammar"] = OrderedDict()

    def claim(self, vocabulary: Vocabulary, params: "StructuredOutputsParams") -> Compilation:
        """The compilation of ``params`` for ``vocabulary`` (done at once if cached), claimed once:
        the caller calls release() when it stops waiting. Its future fails with InvalidRequest for
        a constraint xgrammar refuses: building the grammar happens in the worker too, as it can
        take seconds on a large constraint. Raises Overloaded if its lane is full."""
        key = params.key
        full_key = (vocabulary.key, *key)
        found = self._find(full_key)
        if found is not None:
            return found
        lane = self.lanes["large" if len(key[1]) > SMALL_CONSTRAINT_BYTES else "small"]
        lane.ensure_worker()
        with self.lock:
            found = self._find_locked(full_key)
            if found is not None:
                return found
            compilation = Compilation(full_key, vocabulary, params, lane, claims=1)
            lane.push(compilation)
            self._compiling[full_key] = compilation
            return compilation

    def _find(self, full_key: tuple) -> Compilation | None:
        with self.lock:
            return self._find_locked(full_key)

    def _find_locked(self, full_key: tuple) -> Compilation | None:
        compiled = self._cache.get(full_key)
        if compiled is not None:
            self._cache.move_to_end(full_key)
            done = Compilation(full_key, None, None, None)
            done.future.set_result(compiled)
            return done
        compilation = self._compiling.get(full_key)
        if compilation is not None:
            compilation.claims += 1
        return compilation

    def drop_unclaimed(self, compilation: Compilation) -> bool:
        """True if nobody waits for the compilation any more; it then takes no new claims."""
        with self.lock:
            if compilation.claims > 0:
                return False
            self._compiling.pop(compilation.key, None)
            return True

    def release(self, compilation: Compilation) -> None:
        """A request stops waiting; the last one out of an unfinished compile cancels it."""
        with self.lock:
            if compilation.future.done() or compilation.claims == 0:
                return
            compilation.claims -= 1
            if compilation.claims == 0 and compilation.lane.running is not compilation:
                compilation.lane.queue.remove(compilation)
                self.finish(compilation, CompileCancelled())
            # a running one is stopped by its lane, which looks at its claims while it waits

    def finish(self, compilation: Compilation, outcome: Any) -> None:
        """Under the lock: settle the future; cache only a compiled grammar."""
        if self._compiling.get(compilation.key) is compilation:  # not a newer one of the same key
            del self._compiling[compilation.key]
        if isinstance(outcome, BaseException):
            compilation.future.set_exception(outcome)
            return
        self._cache[compilation.key] = outcome
        while len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        compilation.future.set_result(outcome)

    def num_in_flight(self) -> int:
        """Compiles queued or running."""
        with self.lock:
            return len(self._compiling)

    def shutdown(self) -> None:
        for lane in self.lanes.values():
            lane._stop_worker()


@dataclass
class _Worker:
    process: subprocess.Popen
    conn: Connection
    vocabularies: set[str] = field(default_factory=set)

    @classmethod
    def start(cls) -> "_Worker":
        """A fresh interpreter with its end of the pipe inherited (like the tensor-parallel ranks:
        a multiprocessing child would re-import the caller's main script)."""
        parent, child = Pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        process = subprocess.Popen([sys.executable, "-m", "dabba.structured_output.compile_worker",
                                    str(child.fileno())], pass_fds=[child.fileno()], env=env)
        child.close()
        worker = cls(process, parent)
        if not parent.poll(WORKER_START_TIMEOUT_S):
            worker.kill()
            raise RuntimeError(f"the grammar compiler process did not start within {WORKER_START_TIMEOUT_S:.0f} s")
        try:
            parent.recv()
        except (EOFError, OSError):
            code = process.wait()
            parent.close()
            raise RuntimeError(f"the grammar compiler process exited as it started (exit code {code})") from None
        return worker

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()


_pool: CompilerPool | None = None
_pool_lock = threading.Lock()


def compiler_pool() -> CompilerPool:
    """The process's pool, made on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = CompilerPool()
            atexit.register(_pool.shutdown)
        return _pool
