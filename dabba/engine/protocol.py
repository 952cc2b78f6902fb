"""The one boundary between a front end (the OpenAI server, later the other APIs and a router of
several models) and the engines behind it: the EngineClient protocol and the types it speaks.

A front end holds an EngineClient and its ModelInfo, never an engine: what it may ask is here.
Requests it makes wrong come back as InvalidRequest (naming the field), an engine that cannot
serve any more as EngineDeadError; outputs stream as RequestOutputs."""
from __future__ import annotations

import asyncio
import contextlib
import enum
from typing import AsyncIterator, Callable, Protocol, runtime_checkable

from dabba.core.stats import SchedulerStats
from dabba.engine.model_info import ModelInfo
from dabba.engine.processor import PromptType
from dabba.errors import InvalidRequest, Overloaded
from dabba.lora_request import LoRARequest
from dabba.outputs import RequestOutput
from dabba.sampling_params import SamplingParams

__all__ = ["ENGINE_FAILED", "EngineClient", "EngineDeadError", "InvalidRequest", "ModelInfo", "ModelRouterClient",
           "ModelState", "ModelUnavailable", "Overloaded", "PromptType", "RequestStream", "UNSET"]

ENGINE_FAILED = "the engine failed (the server's log says why); the server is stopping"


class EngineDeadError(RuntimeError):
    """The engine stopped (it failed, or the server is shutting down): nothing more is served."""


class RequestStream:
    """A request's outputs as they come. Leaving the iteration before the request finished
    (client gone, task cancelled) aborts it; its blocks are freed on the engine's next step."""

    def __init__(self, request_id: str, queue: asyncio.Queue, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._queue = queue
        self._abort = abort
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
            self._abort(self.request_id)


@runtime_checkable
class EngineClient(Protocol):
    """What a front end may ask of the engines serving one model (one engine, or data-parallel
    replicas of it). Every coroutine runs on the front end's event loop; run_loop, drain and
    shutdown on threads of the caller's choosing (see each)."""

    model_info: ModelInfo

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          priority: int = 0, compile_timeout: float | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Process and queue a request (with ``lora_request``'s adapter, where the engine serves
        adapters); returns once the engine accepted it, a constrained one once its grammar
        compiled (within ``compile_timeout`` seconds; None: no bound). Raises
        InvalidRequest (a ValueError naming the field) for a request the engine refuses,
        Overloaded when the grammar compilers' queue is full, EngineDeadError when the engine
        no longer serves."""
        ...

    def abort(self, request_id: str) -> None:
        """End a request; its blocks are freed on the engine's next step. Any thread."""
        ...

    async def get_stats(self) -> SchedulerStats:
        """The batch and the KV cache now (summed over replicas)."""
        ...

    async def get_snapshot(self) -> dict:
        """The dashboard's snapshot of the engine now (engine/stats_feed.py)."""
        ...

    def watch_stats(self) -> AsyncIterator[dict | None]:
        """Snapshots as the engine steps; None after a quiet spell (a heartbeat)."""
        ...

    async def render_metrics(self) -> bytes:
        """The Prometheus exposition of the engine's metrics, its gauges taken now."""
        ...

    async def reset_cache(self) -> bool:
        """Forget every cached prefix (the pool's and its tiers'); False while requests run."""
        ...

    def run_loop(self) -> None:
        """Step until shutdown(), on the calling thread (a client made with start_thread=False)."""
        ...

    def drain(self, timeout: float) -> bool:
        """Refuse new requests; give those in flight ``timeout`` seconds; True if all finished."""
        ...

    def shutdown(self) -> None:
        """Abort what is in flight and stop the loop."""
        ...

    @property
    def error(self) -> BaseException | None:
        """Why the engine loop died, if it did."""
        ...

    @property
    def is_running(self) -> bool:
        ...

    @property
    def is_draining(self) -> bool:
        ...


# ---- several models (engine/model_router.py) -----------------------------------------------
UNSET: object = object()  # a request that gave no keep_alive


class ModelState(str, enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


class ModelUnavailable(Exception):
    """A model cannot serve the request now: ``status`` 404 (no such model), 503 (loading, or
    others busy: retry after ``retry_after`` seconds), 507 (it can never fit) or 500 (its load
    failed)."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


class ServedModel(Protocol):
    """One model of a router, as a front end sees it: its client while it is loaded."""

    state: ModelState
    client: EngineClient | None
    load_seconds: float | None  # its last load's

    @property
    def name(self) -> str: ...


class ModelRouterClient(Protocol):
    """What a front end of several models may ask of their router: a lease on a model (loaded
    first if need be) for a request's handling, an unload, the models and their metrics."""

    entries: dict[str, ServedModel]

    async def acquire(self, name: str | None, keep_alive: float | None | object = UNSET) -> ServedModel:
        """The model loaded, leased until release(); ``keep_alive`` (seconds; None: for good)
        replaces its idle time. Raises ModelUnavailable."""
        ...

    def release(self, model: ServedModel) -> None: ...

    def lease(self, name: str | None, keep_alive: float | None | object = UNSET
              ) -> contextlib.AbstractAsyncContextManager[ServedModel]: ...

    async def unload(self, name: str) -> None:
        """Unload once its requests in flight have finished."""
        ...

    async def keep_alive_loop(self, period: float = 1.0) -> None:
        """Unload models idle past their keep_alive, for as long as the server runs."""
        ...

    async def render_metrics(self) -> bytes: ...
