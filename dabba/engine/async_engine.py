"""The engine loop on one thread (its own, or the caller's: `dabba serve` runs it on the main
thread), each request streaming through its own asyncio queue: the EngineClient of one engine.

Only the engine thread touches LLMEngine: a request is processed (tokenized, validated) on the
caller's side, then it, aborts and queries reach the engine thread as typed commands
(engine/commands.py) through a thread-safe queue and take effect before its next step, so a
cancelled request's blocks are freed on the next step and a bad request never disturbs the others."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator

from prometheus_client import generate_latest

from dabba.core.stats import SchedulerStats
from dabba.engine.commands import (AbortAll, AbortRequest, AddRequest, Command, GetSnapshot, GetStats, OutputQueue,
                                   Reply, ResetCache, Wake)
from dabba.engine.llm_engine import LLMEngine
from dabba.engine.metrics import EngineMetrics
from dabba.engine.output_processor import IterationStats
from dabba.engine.processor import EngineRequest, PromptType
from dabba.engine.protocol import ENGINE_FAILED, EngineDeadError, RequestStream
from dabba.engine.stats_feed import StatsFeed, watch
from dabba.errors import InvalidRequest
from dabba.lora_request import LoRARequest
from dabba.outputs import RequestOutput
from dabba.sampling_params import SamplingParams
from dabba.structured_output.compile_pool import Compilation
from dabba.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("dabba")


async def wait_compiled(compilation: Compilation, grammars: StructuredOutputManager, timeout: float | None) -> None:
    """Wait for a request's grammar, then release the claim: its InvalidRequest if it did not
    compile, or did not within ``timeout`` seconds (None: no bound). A caller that leaves (its
    task cancelled) releases it too, so a compile that no request waits for any more stops."""
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(compilation.future)), timeout)
    except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
        raise InvalidRequest("structured_outputs", f"structured_outputs did not compile within {timeout:g} s "
                             "(the server's --structured-outputs-compile-timeout): simplify it") from None
    finally:
        grammars.release(compilation)


class AsyncLLMEngine:
    """The EngineClient of one engine, whose loop runs on one thread. By default it starts its
    own thread; with ``start_thread=False`` the caller runs it with run_loop() (dabba serve runs it
    on the main thread: a decode step launched from a thread other than the main one runs slower,
    an OpenMP thread-team effect; benchmarks/design_choices.py measures it, README gives the figure)."""

    def __init__(self, engine: LLMEngine, model_name: str, start_thread: bool = True,
                 metrics: EngineMetrics | None = None, wake: threading.Event | None = None) -> None:
        self._engine = engine  # the engine thread's alone
        self.model_info = engine.model_info
        self._processor = engine.processor  # thread-safe: requests are processed on the caller's side
        self.prefix_cache = engine.engine_core.prefix_cache_view()  # a router's one reading of engine state
        self.metrics = metrics or EngineMetrics(model_name)
        self.feed = StatsFeed()  # the dashboard's snapshots
        self._commands: queue.Queue[Command] = queue.Queue()
        self._streams: dict[str, OutputQueue] = {}
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._draining = False
        self._idle = threading.Event()  # set by the engine thread whenever no request is in flight
        self.error: BaseException | None = None
        self._wake = wake  # set with every command: a thread that turns several engines' loops waits on it
        if start_thread:
            threading.Thread(target=self.run_loop, name="dabba-engine", daemon=True).start()

    # ---- called from the event loop -----------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          priority: int = 0, compile_timeout: float | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Process a request (off the event loop when that tokenizes, claims a compile or reads an
        adapter), wait for its grammar to compile (up to ``compile_timeout`` seconds), then queue
        it; returns once the engine accepted it, or raises its InvalidRequest."""
        self._check_open()
        return await self.add_processed(await self.process(request_id, prompt, params, priority, compile_timeout,
                                                           lora_request))

    async def process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                      priority: int = 0, compile_timeout: float | None = None,
                      lora_request: LoRARequest | None = None) -> EngineRequest:
        if self._processor.needs_work(prompt, params) or lora_request is not None:
            processing = asyncio.ensure_future(
                asyncio.to_thread(self._processor.process, request_id, prompt, params, priority, lora_request))
            try:
                request = await asyncio.shield(processing)
            except asyncio.CancelledError:  # the thread goes on: a compile it claims is released when it ends
                processing.add_done_callback(self._release_claim)
                raise
        else:
            request = self._processor.process(request_id, prompt, params, priority, lora_request)
        if request.compilation is not None:
            await wait_compiled(request.compilation, self._processor.grammars, compile_timeout)
        return request

    def _release_claim(self, processing: asyncio.Future) -> None:
        """A request processed for a caller that left: its compile, if it claimed one, is released."""
        if not processing.cancelled() and processing.exception() is None:
            compilation = processing.result().compilation
            if compilation is not None:
                self._processor.grammars.release(compilation)

    async def add_processed(self, request: EngineRequest) -> RequestStream:
        """Queue a processed request (a data-parallel client processes it once, then picks the replica)."""
        self._check_open()
        loop = asyncio.get_running_loop()
        outputs = OutputQueue(loop, asyncio.Queue())
        accepted = Reply(loop, loop.create_future())
        self._put_command(AddRequest(request, outputs, accepted))
        try:
            await accepted.future
        except asyncio.CancelledError:
            self.abort(request.request_id)
            raise
        return RequestStream(request.request_id, outputs.queue, self.abort)

    def _check_open(self) -> None:
        if self.error is not None:
            raise EngineDeadError(ENGINE_FAILED)
        if self._draining:
            raise EngineDeadError("the server is shutting down")

    def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    def _send(self, command: Command) -> None:
        self._commands.put(command)
        if self._wake is not None:
            self._wake.set()

    async def _ask(self, command_type: type, *args: object) -> object:
        reply = Reply.on_running_loop()
        self._put_command(command_type(*args, reply))
        return await reply.future

    async def get_stats(self) -> SchedulerStats:
        """A snapshot of the scheduler, taken by the engine thread between two steps (only that
        thread reads the scheduler), so /metrics pays for it when scraped, not every step."""
        return await self._ask(GetStats)

    async def get_snapshot(self) -> dict:
        """The dashboard's snapshot of the engine now (engine/stats_feed.py)."""
        return await self._ask(GetSnapshot)

    async def reset_cache(self) -> bool:
        """Forget every cached prefix, in the pool and the tiers under it; False while requests run."""
        return await self._ask(ResetCache)

    def watch_stats(self) -> AsyncIterator[dict | None]:
        """Snapshots as the engine steps (engine/stats_feed.py's watch)."""
        async def now() -> list[dict]:
            return [await self.get_snapshot()]

        return watch([self.feed], now, lambda latest: latest[0])

    async def render_metrics(self) -> bytes:
        """The scheduler's gauges from a snapshot taken now (when /metrics is scraped), then all."""
        self.metrics.observe_scheduler(await self.get_stats())
        return generate_latest(self.metrics.registry)

    @property
    def num_in_flight(self) -> int:
        """Requests accepted and not yet finished (read by a data-parallel router's thread: a
        dict's length, never mid-update)."""
        return len(self._streams)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._streams

    def _put_command(self, command: Command) -> None:
        self._send(command)
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
        self._send(Wake())  # the engine thread answers: idle now, or when the last finishes
        finished = self._idle.wait(timeout)
        clean = finished and self.error is None
        if not finished:
            self._send(AbortAll("the server is shutting down: the request did not finish in time"))
        return clean

    def shutdown(self) -> None:
        """Abort what is in flight and stop the loop."""
        self._stop.set()
        self._send(Wake())
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
        while self.turn(wait=0.5):
            pass

    def turn(self, wait: float = 0.0) -> bool:
        """One turn of the loop, on the engine thread: the commands queued (waiting up to ``wait``
        seconds for one while no request is in flight), then a step if a request waits. A thread
        that hosts several engines (engine/engine_host.py) turns each in turn. False once the
        loop is over (shut down, or failed: then every stream has its error), for good."""
        if self._stopped.is_set():
            return False
        engine = self._engine
        try:
            if self._stop.is_set():
                self._abort_all("the server is shutting down")
                self._close()
                return False
            self._apply_commands(0.0 if engine.has_unfinished_requests() else wait)
            if engine.has_unfinished_requests():
                outputs, stats = engine.step_with_stats()
                self._publish(outputs, stats)
                if self.feed.watchers:
                    self.feed.publish(engine.engine_core, idle=not engine.has_unfinished_requests())
            elif self.feed.watchers and not self.feed.shows_idle():  # the last requests were aborted
                self.feed.publish(engine.engine_core, idle=True)
            if not self._streams:
                self._idle.set()
            return True
        except BaseException as e:  # the loop is dead: fail every stream rather than hang them
            logger.exception("engine loop failed")
            self.error = e
            for stream in self._streams.values():  # the cause stays in the log, not in responses
                stream.put(EngineDeadError(ENGINE_FAILED))
            self._streams.clear()
            self._close()
            return False

    def end(self) -> None:
        """shutdown() on the engine thread itself (which cannot wait for its own loop): the
        requests in flight end with an error now, and the loop is over."""
        self._stop.set()
        self.turn()

    @property
    def has_work(self) -> bool:
        """Whether a request waits for a step (the engine thread's to ask)."""
        return self._engine.has_unfinished_requests()

    def _close(self) -> None:
        self._stopped.set()
        self._idle.set()  # nothing runs any more (a failed loop has failed its streams)
        self._answer_late_commands()

    def _abort_all(self, reason: str) -> None:
        for request_id, stream in list(self._streams.items()):
            self._engine.abort_request(request_id)
            stream.put(EngineDeadError(reason))
        self._streams.clear()

    def _apply_commands(self, wait: float) -> None:
        while True:
            try:
                command = self._commands.get(timeout=wait) if wait > 0 else self._commands.get_nowait()
            except queue.Empty:
                return
            wait = 0.0
            self._apply(command)

    def _apply(self, command: Command) -> None:
        engine = self._engine
        match command:
            case AddRequest(request, outputs, accepted):
                try:
                    engine.add_processed(request)
                except Exception as e:  # rejected: only this request learns about it
                    accepted.fail(e)
                    return
                self._streams[request.request_id] = outputs
                accepted.send(None)
            case AbortRequest(request_id):
                engine.abort_request(request_id)
                self._streams.pop(request_id, None)
            case GetStats(reply):
                reply.send(engine.get_stats())
            case GetSnapshot(reply):
                reply.send(self.feed.publish(engine.engine_core, idle=not engine.has_unfinished_requests()))
            case ResetCache(reply):
                reply.send(engine.reset_prefix_cache())
            case AbortAll(reason):
                self._abort_all(reason)
            case Wake():
                pass

    def _answer_late_commands(self) -> None:
        """Commands queued as the loop stopped would otherwise wait forever: requests are refused,
        queries are answered here (nothing steps any more)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            match command:
                case AddRequest(_, _, accepted):
                    accepted.fail(EngineDeadError("the engine loop has stopped"))
                case GetStats(reply):
                    reply.send(self._engine.get_stats())
                case GetSnapshot(reply):
                    reply.send(self.feed.publish(self._engine.engine_core, idle=True))
                case ResetCache(reply):
                    reply.send(False)

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
