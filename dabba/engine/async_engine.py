"""The engine loop on one thread (its own, or the caller's: `dabba serve` runs it on the main
thread), each request streaming through its own asyncio queue. Only the engine thread touches
LLMEngine: requests to add or abort reach it through a
thread-safe queue and take effect before its next step, so a cancelled request's blocks are
freed on the next step and a bad request never disturbs the others."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from dabba.core.stats import SchedulerStats
from dabba.engine.llm_engine import LLMEngine, PromptType
from dabba.engine.metrics import EngineMetrics
from dabba.engine.output_processor import IterationStats
from dabba.engine.stats_feed import StatsFeed, watch
from dabba.outputs import RequestOutput
from dabba.sampling_params import SamplingParams

logger = logging.getLogger("dabba")


class EngineDeadError(RuntimeError):
    pass


ENGINE_FAILED = "the engine failed (the server's log says why); the server is stopping"


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None

    def put(self, item: object) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class RequestStream:
    """A request's outputs as they come. Leaving the iteration before the request finished
    (client gone, task cancelled) aborts it; its blocks are freed on the engine's next step."""

    def __init__(self, engine: "AsyncLLMEngine", request_id: str, queue: asyncio.Queue) -> None:
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            if not self.finished:
                self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class AsyncLLMEngine:
    """The engine loop, fed from asyncio. By default it starts its own thread; with
    ``start_thread=False`` the caller runs it with run_loop() (dabba serve runs it on the main
    thread: the same decode step took ~1.5x as long when launched from a thread other than the
    main one, an OpenMP thread-team effect measured at 16 vs 23 ms for 8 rows)."""

    def __init__(self, engine: LLMEngine, model_name: str, start_thread: bool = True,
                 metrics: EngineMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics or EngineMetrics(model_name)
        self.feed = StatsFeed()  # the dashboard's snapshots
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._draining = False
        self._idle = threading.Event()  # set by the engine thread whenever no request is in flight
        self.error: BaseException | None = None
        if start_thread:
            threading.Thread(target=self.run_loop, name="dabba-engine", daemon=True).start()

    # ---- called from the event loop -----------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          priority: int = 0) -> RequestStream:
        """Queue a request; returns once the engine accepted it, or raises its ValueError."""
        if self.error is not None:
            raise EngineDeadError(ENGINE_FAILED)
        if self._draining:
            raise EngineDeadError("the server is shutting down")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        accepted: asyncio.Future = loop.create_future()
        self._put_command(("add", request_id, prompt, params, priority, stream, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, stream.queue)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    async def get_stats(self) -> SchedulerStats:
        """A snapshot of the scheduler, taken by the engine thread between two steps (only that
        thread reads the scheduler), so /metrics pays for it when scraped, not every step."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._put_command(("stats", loop, done))
        return await done

    async def get_snapshot(self) -> dict:
        """The dashboard's snapshot of the engine now (engine/stats_feed.py)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._put_command(("snapshot", loop, done))
        return await done

    def watch_stats(self) -> AsyncIterator[dict | None]:
        """Snapshots as the engine steps (engine/stats_feed.py's watch)."""
        async def now() -> list[dict]:
            return [await self.get_snapshot()]

        return watch([self.feed], now, lambda latest: latest[0])

    async def update_metrics(self) -> None:
        """Set the scheduler's gauges from a snapshot taken now (when /metrics is scraped)."""
        self.metrics.observe_scheduler(await self.get_stats())

    @property
    def num_in_flight(self) -> int:
        """Requests accepted and not yet finished (read by a data-parallel router's thread: a
        dict's length, never mid-update)."""
        return len(self._streams)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._streams

    def _put_command(self, command: tuple) -> None:
        self._commands.put(command)
        if self._stopped.is_set():  # the loop may have drained its queue before this one came
            self._answer_late_commands()

    def drain(self, timeout: float) -> bool:
        """Refuse new requests and wait up to ``timeout`` seconds for those in flight to finish;
        True if they all did. Those still running then end with EngineDeadError (a stream's error
        event), so no client sees a truncated response. Any thread but the engine thread."""
        self._draining = True
        if self._stopped.is_set():
            return self.error is None
        self._idle.clear()
        if self._stopped.is_set():  # stopped in between: its last act was to set _idle
            self._idle.set()
        self._commands.put(("wake",))  # the engine thread answers: idle now, or when the last finishes
        finished = self._idle.wait(timeout)
        clean = finished and self.error is None
        if not finished:
            self._commands.put(("abort_all", "the server is shutting down: the request did not finish in time"))
        return clean

    def shutdown(self) -> None:
        """Abort what is in flight and stop the loop."""
        self._stop.set()
        self._commands.put(("wake",))
        self._stopped.wait(timeout=30)

    @property
    def is_draining(self) -> bool:
        return self._draining

    @property
    def is_running(self) -> bool:
        return not self._stopped.is_set() and self.error is None

    # ---- the engine thread ----------------------------------------------------------------
    def run_loop(self) -> None:
        """Step the engine until shutdown(); the thread that calls it is the engine thread."""
        try:
            self._run()
        finally:
            self._stopped.set()
            self._idle.set()  # nothing runs any more (a failed loop has failed its streams)
            self._answer_late_commands()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                block = not self.engine.has_unfinished_requests()
                self._apply_commands(block)
                if self.engine.has_unfinished_requests():
                    outputs, stats = self.engine.step_with_stats()
                    self._publish(outputs, stats)
                    if self.feed.watchers:
                        self.feed.publish(self.engine, idle=not self.engine.has_unfinished_requests())
                elif self.feed.watchers and not self.feed.shows_idle():  # the last requests were aborted
                    self.feed.publish(self.engine, idle=True)
                if not self._streams:
                    self._idle.set()
        except BaseException as e:  # the loop is dead: fail every stream rather than hang them
            logger.exception("engine loop failed")
            self.error = e
            for stream in self._streams.values():  # the cause stays in the log, not in responses
                stream.put(EngineDeadError(ENGINE_FAILED))
            self._streams.clear()
            return
        self._abort_all("the server is shutting down")

    def _abort_all(self, reason: str) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            stream.put(EngineDeadError(reason))
        self._streams.clear()

    def _apply_commands(self, block: bool) -> None:
        while True:
            try:
                command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            if command[0] == "add":
                _, request_id, prompt, params, priority, stream, accepted = command
                try:
                    self.engine.add_request(request_id, prompt, params, priority)
                except Exception as e:  # rejected: only this request learns about it
                    stream.loop.call_soon_threadsafe(_set_exception, accepted, e)
                    continue
                self._streams[request_id] = stream
                stream.loop.call_soon_threadsafe(_set_result, accepted, None)
            elif command[0] == "abort":
                self.engine.abort_request(command[1])
                self._streams.pop(command[1], None)
            elif command[0] == "stats":
                _, loop, done = command
                loop.call_soon_threadsafe(_set_result, done, self.engine.get_stats())
            elif command[0] == "snapshot":
                _, loop, done = command
                idle = not self.engine.has_unfinished_requests()
                loop.call_soon_threadsafe(_set_result, done, self.feed.publish(self.engine, idle))
            elif command[0] == "abort_all":
                self._abort_all(command[1])

    def _answer_late_commands(self) -> None:
        """Commands queued as the loop stopped would otherwise wait forever: requests are refused,
        snapshots are taken here (nothing steps any more)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                stream, accepted = command[5], command[6]
                stream.loop.call_soon_threadsafe(_set_exception, accepted, EngineDeadError("the engine loop has stopped"))
            elif command[0] == "stats":
                _, loop, done = command
                loop.call_soon_threadsafe(_set_result, done, self.engine.get_stats())
            elif command[0] == "snapshot":
                _, loop, done = command
                loop.call_soon_threadsafe(_set_result, done, self.feed.publish(self.engine, idle=True))

    def _publish(self, outputs: list[RequestOutput], stats: IterationStats) -> None:
        """Metrics come from the step's stats, not from the outputs: a DELTA output holds only
        this step's tokens, and a FINAL_ONLY request has no output until it finished."""
        now = time.monotonic()
        self.feed.num_steps += 1
        for request_id, request_stats in stats.requests.items():
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if request_stats.is_first:
                self.metrics.prompt_tokens.inc(request_stats.num_prompt_tokens)
                self.feed.num_prompt_tokens += request_stats.num_prompt_tokens
                stream.first_token = now
                self.metrics.time_to_first_token.observe(now - stream.arrival)
            self.metrics.generation_tokens.inc(request_stats.num_new_tokens)
            self.feed.num_generated_tokens += request_stats.num_new_tokens
            if request_stats.finished:
                self.metrics.e2e_request_latency.observe(now - stream.arrival)
                if request_stats.num_output_tokens > 1 and stream.first_token is not None:
                    self.metrics.time_per_output_token.observe(
                        (now - stream.first_token) / (request_stats.num_output_tokens - 1))
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream.put(out)


def _set_result(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
