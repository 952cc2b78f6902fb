"""One thread that runs the loops of several engines (a server of several models): each turn,
every engine applies its commands and, if it has requests, takes a step. They share the thread,
and so the one OpenMP thread team, as one engine's loop has it to itself: `dabba serve` runs this
on the main thread for the reason it runs a single engine's loop there (engine/async_engine.py).

Engines join as they load and leave as they stop (shutdown() or a failed loop); a thread that is
not this one adds and stops them, this one only turns them."""
from __future__ import annotations

import threading

from dabba.engine.async_engine import AsyncLLMEngine


class EngineHost:
    def __init__(self) -> None:
        self.wake = threading.Event()  # give it to each AsyncLLMEngine: set by every command sent to one
        self._engines: list[AsyncLLMEngine] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.stopped = threading.Event()

    def add(self, engine: AsyncLLMEngine) -> None:
        """Start turning ``engine`` (made with start_thread=False and this host's ``wake``)."""
        with self._lock:
            self._engines.append(engine)
        self.wake.set()

    @property
    def engines(self) -> list[AsyncLLMEngine]:
        with self._lock:
            return list(self._engines)

    def run_loop(self) -> None:
        """Turn every engine until stop(); idle ones cost a wait on ``wake``, not a spin."""
        try:
            while not self._stop.is_set():
                self.wake.clear()  # a command sent from here on sets it again: none is missed
                busy = False
                for engine in self.engines:
                    if not engine.turn(wait=0.0):  # shut down, or failed: it leaves the host
                        with self._lock:
                            self._engines.remove(engine)
                    elif engine.has_work:
                        busy = True
                if not busy:
                    self.wake.wait(0.5)
        finally:
            for engine in self.engines:  # stopped: each ends its streams with an error, as shutdown() does
                engine.end()
            self.stopped.set()

    def stop(self) -> None:
        """Stop turning (from another thread); engines still here end what they have in flight."""
        self._stop.set()
        self.wake.set()
