"""Several models behind one server, each its own engine (scheduler, KV cache, worker), loaded on
first use and unloaded when idle (Ollama's keep_alive) or when the next one does not fit.

Every model has a state: unloaded -> loading -> loaded -> unloading -> unloaded. A request leases
its model (acquire/release): an unloaded one starts loading, and requests that arrive while it
loads or unloads wait, at most ``max_waiting`` of them a model (the next is refused, 503 with
Retry-After). A load first makes room: models are unloaded, least recently used first, until the
planned footprint (engine/model_footprint.py) fits the memory budget; one with a lease or a
request in flight is never chosen. An unload waits for the model's leases and requests in flight
to end. Loads run one at a time, off the event loop; the engines' loops all run on one thread
(engine/engine_host.py). Everything else here runs on the event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from prometheus_client import generate_latest

from dabba.config import EngineConfig
from dabba.engine.async_engine import AsyncLLMEngine
from dabba.engine.engine_host import EngineHost
from dabba.engine.llm_engine import LLMEngine
from dabba.engine.metrics import EngineMetrics, MetricFamilies
from dabba.engine.protocol import UNSET, ModelState, ModelUnavailable
from dabba.engine.model_footprint import Footprint, plan_footprint
from dabba.worker.memory import release_freed_host_memory

logger = logging.getLogger("dabba")

GiB = 2**30


@dataclass(frozen=True)
class ModelSpec:
    """One model a server may serve: its name (the request's ``model``), its engine options, and
    how long it stays loaded with nothing to do (seconds; None: until memory is needed)."""
    name: str
    config: EngineConfig
    keep_alive: float | None = None


@dataclass(eq=False)
class ModelEntry:
    spec: ModelSpec
    keep_alive: float | None  # now: a request's keep_alive sets it for what follows, as Ollama's
    state: ModelState = ModelState.UNLOADED
    client: AsyncLLMEngine | None = None
    engine: LLMEngine | None = None
    footprint: Footprint | None = None  # planned at the first load
    config: EngineConfig | None = None  # spec.config with its KV budget made explicit
    leases: int = 0
    waiting: int = 0  # requests waiting for a load or unload to end
    last_used: float = 0.0
    load_seconds: float | None = None  # the last load's
    transition: asyncio.Future | None = None  # the load or unload under way
    unleased: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def busy(self) -> bool:
        return self.leases > 0 or (self.client is not None and self.client.num_in_flight > 0)


class ModelRouter:
    def __init__(self, specs: list[ModelSpec], memory_budget: int, max_waiting: int = 64,
                 clock: Callable[[], float] = time.monotonic,
                 build_engine: Callable[[EngineConfig], LLMEngine] = LLMEngine) -> None:
        if not specs:
            raise ValueError("a router needs at least one model")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must differ, got {names}")
        self.entries = {s.name: ModelEntry(s, s.keep_alive) for s in specs}
        self.memory_budget, self.max_waiting = memory_budget, max_waiting
        self._clock, self._build = clock, build_engine
        self.host = EngineHost()
        self.families = MetricFamilies()  # every model's series in one registry, labelled model_name
        self._load_lock: asyncio.Lock | None = None  # made on the event loop, at the first load
        self._draining = False

    def plan(self) -> None:
        """Plan every model's footprint now (a ValueError naming the model), so that a model
        that cannot be planned fails the server's start, not its first request."""
        for entry in self.entries.values():
            try:
                entry.footprint, entry.config = plan_footprint(entry.spec.config)
            except ValueError as e:
                raise ValueError(f"model {entry.name}: {e}") from None

    # ---- leases ----------------------------------------------------------------------
    def entry(self, name: str | None) -> ModelEntry:
        entry = self.entries.get(name) if name is not None else None
        if entry is None:
            raise ModelUnavailable(404, f"The model `{name}` does not exist (served here: "
                                        f"{', '.join(sorted(self.entries))}).")
        return entry

    async def acquire(self, name: str | None, keep_alive: float | None | object = UNSET) -> ModelEntry:
        """The model, loaded, with a lease the caller releases (release()); ``keep_alive``, when
        given, replaces its idle time from now on. Raises ModelUnavailable."""
        entry = self.entry(name)
        if self._draining:
            raise ModelUnavailable(503, "the server is shutting down")
        while entry.state is not ModelState.LOADED:
            if entry.waiting >= self.max_waiting:
                raise ModelUnavailable(503, f"the model `{entry.name}` is {entry.state.value} and "
                                            f"{entry.waiting} requests already wait for it", self._retry_after(entry))
            if entry.state is ModelState.UNLOADED:
                entry.state = ModelState.LOADING  # now: a request in this same tick waits for this load
                entry.transition = asyncio.ensure_future(self._load(entry))
            entry.waiting += 1
            try:
                await asyncio.shield(entry.transition)
            finally:
                entry.waiting -= 1
        entry.leases += 1
        entry.unleased.clear()
        entry.last_used = self._clock()
        if keep_alive is not UNSET:
            entry.keep_alive = keep_alive  # type: ignore[assignment]
        return entry

    def release(self, entry: ModelEntry) -> None:
        entry.leases -= 1
        entry.last_used = self._clock()
        if entry.leases == 0:
            entry.unleased.set()

    @contextlib.asynccontextmanager
    async def lease(self, name: str | None, keep_alive: float | None | object = UNSET) -> AsyncIterator[ModelEntry]:
        entry = await self.acquire(name, keep_alive)
        try:
            yield entry
        finally:
            self.release(entry)

    def _retry_after(self, entry: ModelEntry) -> float:
        return max(1.0, round(entry.load_seconds or 10.0))

    # ---- loading and unloading --------------------------------------------------------
    async def _load(self, entry: ModelEntry) -> None:
        if self._load_lock is None:
            self._load_lock = asyncio.Lock()
        try:
            async with self._load_lock:  # one at a time: a load takes every core it can
                if entry.footprint is None:
                    entry.footprint, entry.config = await asyncio.to_thread(plan_footprint, entry.spec.config)
                await self._make_room(entry)
                start = time.perf_counter()
                engine = await asyncio.to_thread(self._build, entry.config)
                entry.load_seconds = time.perf_counter() - start
                metrics = EngineMetrics(entry.name, families=self.families)
                entry.engine = engine
                entry.client = AsyncLLMEngine(engine, entry.name, start_thread=False, metrics=metrics,
                                              wake=self.host.wake)
                self.host.add(entry.client)
        except ModelUnavailable:
            entry.state = ModelState.UNLOADED
            raise
        except Exception as e:
            entry.state = ModelState.UNLOADED
            logger.exception("loading the model %s failed", entry.name)
            raise ModelUnavailable(500, f"the model `{entry.name}` failed to load: {e}") from None
        entry.state = ModelState.LOADED
        entry.last_used = self._clock()
        logger.info("Loaded the model %s in %.1f s (%.2f GiB planned)", entry.name, entry.load_seconds,
                    entry.footprint.total / GiB)

    def used_memory(self, but: ModelEntry | None = None) -> int:
        """The planned footprints of the models loaded, loading or unloading (``but`` aside)."""
        return sum(e.footprint.total for e in self.entries.values()
                   if e is not but and e.state is not ModelState.UNLOADED and e.footprint is not None)

    async def _make_room(self, entry: ModelEntry) -> None:
        need = entry.footprint.total
        what = (f"the model `{entry.name}` needs {need / GiB:.2f} GiB (weights {entry.footprint.weights_bytes / GiB:.2f}"
                f" + KV cache {entry.footprint.kv_cache_bytes / GiB:.2f}, as `dabba plan` counts them)")
        if need > self.memory_budget:
            raise ModelUnavailable(507, f"{what}, more than the server's whole budget of "
                                        f"{self.memory_budget / GiB:.2f} GiB (--models-memory)")
        while self.used_memory(but=entry) + need > self.memory_budget:
            idle = [e for e in self.entries.values() if e.state is ModelState.LOADED and not e.busy]
            if not idle:
                busy = [e.name for e in self.entries.values() if e.state is not ModelState.UNLOADED and e is not entry]
                raise ModelUnavailable(503, f"{what}; {(self.memory_budget - self.used_memory(but=entry)) / GiB:.2f} "
                                            f"GiB of the {self.memory_budget / GiB:.2f} GiB budget are free while "
                                            f"{', '.join(busy)} serve requests", retry_after=5.0)
            victim = min(idle, key=lambda e: e.last_used)
            logger.info("Unloading the model %s (least recently used) to make room for %s", victim.name, entry.name)
            await self._unload(victim)

    async def unload(self, name: str) -> None:
        """Unload ``name`` (an operator's POST /models/unload): its requests in flight finish first;
        requests that arrive meanwhile wait, then load it again."""
        entry = self.entry(name)
        while entry.state is ModelState.LOADING:
            await asyncio.shield(entry.transition)
        if entry.state is ModelState.UNLOADING:
            await asyncio.shield(entry.transition)
        elif entry.state is ModelState.LOADED:
            await self._unload(entry)

    async def _unload(self, entry: ModelEntry) -> None:
        entry.state = ModelState.UNLOADING
        entry.transition = asyncio.ensure_future(self._finish_unload(entry))
        await asyncio.shield(entry.transition)

    async def _finish_unload(self, entry: ModelEntry) -> None:
        try:
            if entry.leases:
                await entry.unleased.wait()
            client, engine = entry.client, entry.engine
            await asyncio.to_thread(client.drain, threading.TIMEOUT_MAX)  # those in flight finish
            await asyncio.to_thread(client.shutdown)  # the host's next turn ends its loop
            await asyncio.to_thread(engine.shutdown)
        finally:
            entry.client = entry.engine = None
            entry.state = ModelState.UNLOADED
            await asyncio.to_thread(_free_memory)
            logger.info("Unloaded the model %s", entry.name)

    def expire(self) -> list[str]:
        """Start unloading every model idle past its keep_alive; their names."""
        now = self._clock()
        expired = [e for e in self.entries.values() if e.state is ModelState.LOADED and not e.busy
                   and e.keep_alive is not None and now - e.last_used >= e.keep_alive]
        for e in expired:
            logger.info("Unloading the model %s: idle for %.0f s (keep_alive %g s)", e.name, now - e.last_used,
                        e.keep_alive)
            e.state = ModelState.UNLOADING
            e.transition = asyncio.ensure_future(self._finish_unload(e))
        return [e.name for e in expired]

    def touch(self) -> None:
        """A model with requests in flight is in use now: its keep_alive counts from their end. A
        model whose engine loop failed (its requests have their errors) is unloaded."""
        now = self._clock()
        for e in self.entries.values():
            if e.state is ModelState.LOADED and e.client.error is not None:
                logger.error("the model %s's engine failed; it is unloaded, to load again on its next request", e.name)
                e.state = ModelState.UNLOADING
                e.transition = asyncio.ensure_future(self._finish_unload(e))
            elif e.state is ModelState.LOADED and e.busy:
                e.last_used = now

    async def keep_alive_loop(self, period: float = 1.0) -> None:
        """touch() and expire() every ``period`` seconds, for as long as the server runs."""
        while True:
            self.touch()
            self.expire()
            await asyncio.sleep(period)

    # ---- the server's life -------------------------------------------------------------
    async def render_metrics(self) -> bytes:
        """Every loaded model's series (labelled model_name), their gauges taken now."""
        for client in self.clients():
            client.metrics.observe_scheduler(await client.get_stats())
        return generate_latest(self.families.registry)

    def clients(self) -> list[AsyncLLMEngine]:
        return [e.client for e in self.entries.values() if e.client is not None]

    def run_loop(self) -> None:
        self.host.run_loop()

    def drain(self, timeout: float) -> bool:
        """Refuse new requests; give every model's requests in flight ``timeout`` seconds in all."""
        self._draining = True
        deadline = time.monotonic() + timeout
        # a model whose loop failed has failed its own requests already: it does not fail the drain
        return all([c.drain(max(deadline - time.monotonic(), 0.0)) for c in self.clients() if c.error is None])

    def shutdown(self) -> None:
        for client in self.clients():
            client.shutdown()
        self.host.stop()
        self.host.stopped.wait(timeout=30)
        for e in self.entries.values():
            if e.engine is not None:
                e.engine.shutdown()

    @property
    def error(self) -> BaseException | None:
        return None  # a model whose loop failed is unloaded by itself; the server goes on

    @property
    def is_running(self) -> bool:
        return not self.host.stopped.is_set()

    @property
    def is_draining(self) -> bool:
        return self._draining


def _free_memory() -> None:
    gc.collect()
    release_freed_host_memory()
