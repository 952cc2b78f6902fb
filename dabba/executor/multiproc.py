"""Tensor-parallel ranks as local processes, each pinned to its share of the cores, driven over a
pipe each: the engine sends every rank the same call and waits for the answers, or for a rank's
death (its end of the pipe closes), whichever comes first.

A rank is a fresh interpreter running ``python -m dabba.executor.rank`` with its end of the pipe
inherited, not a multiprocessing child: those re-import the parent's main script, which runs the
script's own LLM(...) again wherever it lacks an ``if __name__ == "__main__"`` guard."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
import weakref
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from dabba.distributed.shm_communicator import create_segment
from dabba.executor.base import RemoteExecutor, WorkerDiedError, split_cores
from dabba.executor.rank import RankPlace
from dabba.models.resolved_config import ResolvedConfig


class MultiprocExecutor(RemoteExecutor):
    def __init__(self, resolved: ResolvedConfig, size: int, replica: int = 0, replicas: int = 1) -> None:
        self.tp_size = size
        cores = split_cores(size, replica, replicas) if resolved.device.type == "cpu" else [None] * size
        self._rendezvous = tempfile.TemporaryDirectory(prefix="dabba-tp-")
        init_method = (Path(self._rendezvous.name) / "store").as_uri()  # a file store: no port to pick
        self.shm_path = create_segment(size) if resolved.device.type == "cpu" and size > 1 else None
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the engine's imports
        self.conns: list[Connection] = []
        self.procs: list[subprocess.Popen] = []
        for rank in range(size):
            parent, child = multiprocessing.Pipe()
            self.procs.append(subprocess.Popen([sys.executable, "-m", "dabba.executor.rank", str(child.fileno())],
                                               pass_fds=[child.fileno()], env=env))
            child.close()
            place = RankPlace(rank, size, init_method, cores[rank], replica * size + rank, self.shm_path)
            parent.send((resolved, place))
            self.conns.append(parent)
        self.broken: BaseException | None = None
        self._finalizer = weakref.finalize(self, _stop, self.conns, self.procs, self._rendezvous, self.shm_path,
                                           weakref.ref(self))
        try:
            self._answers()  # each rank says it is built, or why not
        except BaseException:
            self.shutdown()
            raise

    def _call(self, method: str, *args: Any) -> list[Any]:
        if self.broken is not None:
            raise WorkerDiedError(f"the tensor-parallel workers stopped earlier: {self.broken}")
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((method, args))
            except OSError:  # its process is gone
                self._fail(WorkerDiedError(f"tensor-parallel rank {rank} exited (exit code {self.procs[rank].wait()})"))
        return self._answers()

    def _answers(self) -> list[Any]:
        """Every rank's answer, in rank order. A rank that fails or dies fails the call at once
        (the others may be blocked in a collective that will never complete) and stops them all."""
        answers: dict[int, Any] = {}
        waiting = {conn: rank for rank, conn in enumerate(self.conns)}
        while waiting:
            for ready in wait(list(waiting)):
                rank = waiting.pop(ready)
                try:
                    ok, value = ready.recv()
                except (EOFError, OSError):  # its process is gone
                    code = self.procs[rank].wait()
                    ok, value = False, WorkerDiedError(f"tensor-parallel rank {rank} exited (exit code {code})")
                if not ok:
                    self._fail(value)
                answers[rank] = value
        return [answers[rank] for rank in range(len(self.conns))]

    def _fail(self, error: BaseException) -> None:
        self.broken = error
        self.shutdown()
        raise error

    def shutdown(self) -> None:
        self._finalizer()


def _stop(conns: list[Connection], procs: list[subprocess.Popen], rendezvous: tempfile.TemporaryDirectory,
          shm_path: str | None, executor_ref: weakref.ref) -> None:
    """Ask the ranks to leave (unless the group broke), give them 5 s, then kill what is left.
    Runs once: from shutdown(), or when the executor is collected or the interpreter exits."""
    executor = executor_ref()
    graceful = executor is None or executor.broken is None
    for conn, proc in zip(conns, procs):
        if graceful and proc.poll() is None:
            try:
                conn.send(("shutdown", ()))
            except OSError:
                pass
    for proc in procs:
        try:
            proc.wait(timeout=5 if graceful else 0.1)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for conn in conns:
        conn.close()
    rendezvous.cleanup()
    if shm_path is not None:
        os.unlink(shm_path)
