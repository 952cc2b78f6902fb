"""Data parallelism: N engine replicas behind one server (`dabba serve --data-parallel-size N`).

Each replica is a whole engine: its scheduler, KV cache and detokenizer step on a thread of this
process, its model runs in worker processes pinned to its own share of the cores (executor/).
A request goes to the replica that already caches the longest prefix of it, else to the least
loaded one (SGLang's cache-aware routing, asked of each replica's own block hashes).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import Counter
from typing import AsyncIterator

from prometheus_client import generate_latest

from dabba.config import EngineConfig
from dabba.core.request import BlockHash
from dabba.core.stats import SchedulerStats
from dabba.engine.async_engine import AsyncLLMEngine
from dabba.engine.llm_engine import LLMEngine
from dabba.engine.metrics import EngineMetrics
from dabba.engine.processor import PromptType
from dabba.engine.protocol import EngineDeadError, InvalidRequest, RequestStream
from dabba.engine.stats_feed import combine_snapshots, watch
from dabba.lora_request import LoRARequest
from dabba.sampling_params import SamplingParams

logger = logging.getLogger("dabba")

# The loads are out of balance, and a request goes to the least loaded replica whatever the
# others cache, when the busiest replica has more than IMBALANCE_REQUESTS requests in flight
# beyond the least loaded one and more than IMBALANCE_RATIO times as many (SGLang's rule).
IMBALANCE_REQUESTS = 4
IMBALANCE_RATIO = 1.5


def choose_replica(hits: list[int], loads: list[int], start: int = 0) -> int:
    """The replica for a request, given how many leading blocks of its prompt each one caches
    (``hits``) and how many requests each has in flight (``loads``): the longest hit (the least
    loaded among equal hits) while the loads are in balance, else the least loaded. Equals are
    taken in turn from ``start``, so that an idle server spreads new prefixes over its replicas."""
    least, most = min(loads), max(loads)
    balanced = not (most - least > IMBALANCE_REQUESTS and most > IMBALANCE_RATIO * least)
    best = max(hits)
    candidates = [i for i, h in enumerate(hits) if h == best] if balanced and best > 0 else range(len(loads))
    low = min(loads[i] for i in candidates)
    return min((i for i in candidates if loads[i] == low), key=lambda i: (i - start) % len(loads))


def leading_in(hashes: list[BlockHash], present: Counter) -> int:
    """How many leading blocks of a prompt are among ``present``'s (chained hashes: a block's hash
    there means its whole prefix is there too)."""
    n = 0
    while n < len(hashes) and present[hashes[n]]:
        n += 1
    return n


class PrefixRouter:
    """Picks each request's replica. A replica's hit is the longer of what its KV cache holds and
    what its requests in flight share with the prompt (their blocks are cached as they are
    computed: requests that arrive together and share a prefix should meet at one replica)."""

    def __init__(self, replicas: list[AsyncLLMEngine]) -> None:
        self.replicas = replicas
        self._prompts: list[dict[str, list[BlockHash]]] = [{} for _ in replicas]  # in flight, per replica
        self._blocks: list[Counter] = [Counter() for _ in replicas]  # those prompts' block hashes, counted
        self._adding: dict[str, int] = {}  # routed, not yet accepted: request id -> replica
        self._turn = 0
        self.routed = [0] * len(replicas)  # requests sent to each replica

    def route(self, request_id: str, hashes: list[BlockHash]) -> int:
        """The replica for a prompt, by the hashes of the blocks a cache could serve of it (the
        processor's request computed them) against each replica's prefix cache (its
        PrefixCacheView) and in-flight prompts."""
        hits, loads = [], []
        for i, replica in enumerate(self.replicas):
            prompts = self._prompts[i]
            for gone in [r for r in prompts if not replica.has_request(r) and self._adding.get(r) != i]:
                self._forget(i, gone)
            adding = sum(1 for r in self._adding.values() if r == i)
            loads.append(replica.num_in_flight + adding)
            cached = replica.prefix_cache.leading_blocks(hashes) if hashes else 0
            hits.append(max(cached, leading_in(hashes, self._blocks[i])))
        choice = choose_replica(hits, loads, self._turn)
        self._turn = (choice + 1) % len(self.replicas)
        self._adding[request_id] = choice
        self._prompts[choice][request_id] = hashes
        self._blocks[choice].update(hashes)
        self.routed[choice] += 1
        logger.debug("request %s -> replica %d (cached blocks %s, in flight %s)", request_id, choice, hits, loads)
        return choice

    def in_flight(self, request_id: str) -> bool:
        """Whether a replica serves the request id now (or it is on its way to one)."""
        return request_id in self._adding or any(r.has_request(request_id) for r in self.replicas)

    def accepted(self, request_id: str, ok: bool) -> None:
        """The replica took the request (it is in flight there until it ends), or refused it."""
        replica = self._adding.pop(request_id)
        if not ok:
            self._forget(replica, request_id)

    def _forget(self, replica: int, request_id: str) -> None:
        blocks = self._blocks[replica]
        for block_hash in self._prompts[replica].pop(request_id):
            blocks[block_hash] -= 1
            if not blocks[block_hash]:
                del blocks[block_hash]


def build_replicas(config: EngineConfig) -> list[LLMEngine]:
    """Every replica, loading side by side (each into its own worker processes)."""
    replicas = config.parallel_config.data_parallel_size
    with concurrent.futures.ThreadPoolExecutor(replicas) as pool:
        futures = [pool.submit(LLMEngine, config, i) for i in range(replicas)]
        concurrent.futures.wait(futures)
    engines = [f.result() for f in futures if f.exception() is None]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for engine in engines:
            engine.shutdown()
        raise failed[0]
    return engines


class DataParallelEngine:
    """The replicas behind the server, as one EngineClient: each replica's loop on a thread of its
    own (started here, or by the caller's run_loop()). A request is processed once, then routed.
    A replica that fails stops them all, as one engine's failure stops the server (a supervisor
    restarts it)."""

    def __init__(self, engines: list[LLMEngine], model_name: str, start_thread: bool = True) -> None:
        replica_metrics, self.metrics = EngineMetrics.replicated(model_name, len(engines))
        self.replicas = [AsyncLLMEngine(engine, model_name, start_thread=False, metrics=metrics)
                         for engine, metrics in zip(engines, replica_metrics)]
        self.model_info = self.replicas[0].model_info  # the same model in every replica
        self.router = PrefixRouter(self.replicas)
        self._draining = False
        self._stopped = threading.Event()
        if start_thread:
            threading.Thread(target=self.run_loop, name="dabba-replicas", daemon=True).start()

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          priority: int = 0, compile_timeout: float | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        self._check_open()
        # the same in every replica (they share the process's grammar compiles)
        request = await self.replicas[0].process(request_id, prompt, params, priority, compile_timeout, lora_request)
        self._check_open()
        if self.router.in_flight(request_id):  # a replica would refuse it only if it held it itself
            raise InvalidRequest("request_id", f"request_id {request_id!r} is already in use")
        replica = self.router.route(request_id, request.samples[0].prefix_block_hashes)
        try:
            stream = await self.replicas[replica].add_processed(request)
        except BaseException:
            self.router.accepted(request_id, ok=False)
            raise
        self.router.accepted(request_id, ok=True)
        return stream

    def _check_open(self) -> None:
        if self.error is not None:
            raise EngineDeadError("a data-parallel replica failed (the server's log says why); the server is stopping")
        if self._draining:
            raise EngineDeadError("the server is shutting down")

    def abort(self, request_id: str) -> None:
        for replica in self.replicas:  # a request id runs in one replica; the others ignore it
            replica.abort(request_id)

    async def get_stats(self) -> SchedulerStats:
        return SchedulerStats.combine(list(await asyncio.gather(*(r.get_stats() for r in self.replicas))))

    async def reset_cache(self) -> bool:
        return all(await asyncio.gather(*(r.reset_cache() for r in self.replicas)))

    async def render_metrics(self) -> bytes:
        """Each replica's gauges from its stats, and the sum's (replica="all") from them all: one
        registry (engine/metrics.py)."""
        stats = list(await asyncio.gather(*(r.get_stats() for r in self.replicas)))
        for replica, replica_stats in zip(self.replicas, stats):
            replica.metrics.observe_scheduler(replica_stats)
        self.metrics.observe_scheduler(SchedulerStats.combine(stats))
        return generate_latest(self.metrics.registry)

    async def _snapshots(self) -> list[dict]:
        return list(await asyncio.gather(*(r.get_snapshot() for r in self.replicas)))

    async def get_snapshot(self) -> dict:
        return combine_snapshots(await self._snapshots())

    def watch_stats(self) -> AsyncIterator[dict | None]:
        return watch([r.feed for r in self.replicas], self._snapshots, combine_snapshots)

    def run_loop(self) -> None:
        """Run every replica's loop, each on a thread of its own, until shutdown() or until one
        of them fails (then the others stop too, their requests ending with an error)."""
        one_stopped = threading.Event()

        def run(replica: AsyncLLMEngine) -> None:
            try:
                replica.run_loop()
            finally:
                one_stopped.set()

        threads = [threading.Thread(target=run, args=(r,), name=f"dabba-engine-{i}", daemon=True)
                   for i, r in enumerate(self.replicas)]
        for thread in threads:
            thread.start()
        one_stopped.wait()
        if self.error is not None:
            logger.error("a data-parallel replica failed: stopping the others")
        for replica in self.replicas:
            replica.shutdown()
        for thread in threads:
            thread.join()
        self._stopped.set()

    def drain(self, timeout: float) -> bool:
        """Refuse new requests; give those in flight, in every replica, ``timeout`` seconds in all."""
        self._draining = True
        results: list[bool] = [False] * len(self.replicas)

        def drain_one(i: int) -> None:
            results[i] = self.replicas[i].drain(timeout)

        threads = [threading.Thread(target=drain_one, args=(i,)) for i in range(len(self.replicas))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return all(results)

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()
        self._stopped.wait(timeout=30)

    @property
    def error(self) -> BaseException | None:
        return next((r.error for r in self.replicas if r.error is not None), None)

    @property
    def is_draining(self) -> bool:
        return self._draining

    @property
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)
