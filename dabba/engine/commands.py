"""What a front end asks of the engine thread, one typed command each (vLLM v1's
EngineCoreRequestType, as dataclasses): the thread applies them between two steps, in order, and
answers queries through a Reply, so that only it ever reads or changes the EngineCore."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from dabba.engine.processor import EngineRequest


@dataclass
class Reply:
    """An answer the engine thread sends back to a future on the asker's event loop."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    @classmethod
    def on_running_loop(cls) -> "Reply":
        loop = asyncio.get_running_loop()
        return cls(loop, loop.create_future())

    def send(self, value: Any) -> None:
        _call_soon(self.loop, _set_result, self.future, value)

    def fail(self, error: BaseException) -> None:
        _call_soon(self.loop, _set_exception, self.future, error)


@dataclass
class OutputQueue:
    """Where a request's outputs go: an asyncio queue on the asker's loop, fed from the engine
    thread; with the times its metrics need."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None

    def put(self, item: object) -> None:
        _call_soon(self.loop, self.queue.put_nowait, item)


@dataclass
class AddRequest:
    """Queue a processed request; ``accepted`` gets None, or the InvalidRequest that refused it."""

    request: EngineRequest
    outputs: OutputQueue
    accepted: Reply


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class AbortAll:
    """End every request in flight with EngineDeadError(reason) (a drain that ran out of time)."""

    reason: str


@dataclass
class Wake:
    """Nothing to do: wakes a thread that waits for commands (to see shutdown or drain)."""


@dataclass
class GetStats:
    reply: Reply  # -> SchedulerStats


@dataclass
class GetSnapshot:
    reply: Reply  # -> the dashboard's snapshot (engine/stats_feed.py)


Command = AddRequest | AbortRequest | AbortAll | Wake | GetStats | GetSnapshot


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Any, *args: object) -> None:
    """On the asker's loop; a loop that has closed (its caller gone) takes nothing more, and
    that is no failure of the engine thread, which serves the others."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise


def _set_result(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


@dataclass
class ResetCache:
    reply: Reply  # -> bool: every cached prefix (pool and tiers) forgotten; False while requests run
