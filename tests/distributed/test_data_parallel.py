"""Data-parallel replicas behind one server: the router sends requests that share a prefix to the
replica caching it (or computing it), spreads the others, and the replicas' tokens are one
engine's; /metrics shows each replica and their sum; a replica that dies stops the server."""
from __future__ import annotations

import asyncio
import os
import re
from typing import Callable

import httpx
import pytest

from dabba import LLM, SamplingParams
from dabba.config import EngineConfig
from dabba.core.stats import SchedulerStats
from dabba.engine.data_parallel import (IMBALANCE_REQUESTS, DataParallelEngine, build_replicas, choose_replica)
from tests.conftest import token_prompts
from tests.entrypoints.live_server import live_server

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_the_longest_cached_prefix_wins_while_the_loads_are_in_balance() -> None:
    assert choose_replica(hits=[0, 3], loads=[0, 0]) == 1
    assert choose_replica(hits=[2, 2], loads=[3, 1]) == 1  # equal hits: the least loaded
    assert choose_replica(hits=[0, 0], loads=[2, 1]) == 1  # no hit: the least loaded
    assert choose_replica(hits=[5, 0], loads=[IMBALANCE_REQUESTS, 0]) == 0
    assert choose_replica(hits=[5, 0], loads=[IMBALANCE_REQUESTS + 1, 0]) == 1  # out of balance
    assert choose_replica(hits=[5, 0], loads=[IMBALANCE_REQUESTS + 3, 3]) == 0  # 7 is not 1.5 x 3
    assert [choose_replica([0, 0, 0], [0, 0, 0], start) for start in range(3)] == [0, 1, 2]  # equals in turn


def test_replica_stats_combine_into_one_engines() -> None:
    a = SchedulerStats(1, 2, 0.5, 0.25, 1, kv_blocks_total=100, kv_blocks_used=50, prefix_cache_hit_tokens=10,
                       prefix_cache_queried_tokens=40)
    b = SchedulerStats(3, 0, 0.0, 1.0, 2, kv_blocks_total=300, kv_blocks_used=0, prefix_cache_hit_tokens=60,
                       prefix_cache_queried_tokens=60)
    both = SchedulerStats.combine([a, b])
    assert (both.num_running_reqs, both.num_waiting_reqs, both.num_preemptions) == (4, 2, 3)
    assert both.kv_cache_usage == 50 / 400 and both.prefix_cache_hit_rate == 70 / 100


@pytest.fixture
def replica_engines(checkpoints):
    engines = build_replicas(EngineConfig.from_kwargs(model=str(checkpoints["llama"].path), dtype="float32",
                                                      max_num_batched_tokens=256, data_parallel_size=2))
    yield engines
    for engine in engines:
        engine.shutdown()


@pytest.fixture
def replicas(replica_engines):
    dp = DataParallelEngine(replica_engines, "tiny")
    yield dp
    dp.shutdown()


async def generate(dp: DataParallelEngine, prompts: list[list[int]], tag: str) -> list[list[int]]:
    """All at once: every request is routed before any runs."""
    async def one(i: int, prompt: list[int]) -> list[int]:
        out = None
        async for out in await dp.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, GREEDY):
            pass
        return out.outputs[0].token_ids

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def hit_tokens(dp: DataParallelEngine) -> list[int]:
    return [asyncio.run(r.get_stats()).prefix_cache_hit_tokens for r in dp.replicas]


def check_replicas(config: EngineConfig, prompts: list[list[int]], expected: list, assert_same: Callable) -> None:
    """Two replicas of ``config`` (data_parallel_size 2): all of ``prompts`` at once give ``expected``
    (held by ``assert_same``, the caller's bar); then prompts sharing the last prompt's first four
    blocks go, one at a time, to the replica that caches them."""
    engines = build_replicas(config)
    replicas = DataParallelEngine(engines, "tiny")
    try:
        outputs = asyncio.run(generate(replicas, prompts, "all"))
        assert [len(o) for o in outputs] == [GREEDY.max_tokens] * len(prompts)
        assert_same(outputs, expected)
        assert min(replicas.router.routed) >= 1
        prefix = prompts[-1][:64]  # four blocks
        asyncio.run(generate(replicas, [prefix + [5, 6, 7]], "first"))
        served = replicas.router.routed.index(max(replicas.router.routed))
        before = hit_tokens(replicas)
        for i, tail in enumerate(([8, 9], [10, 11, 12, 13])):
            asyncio.run(generate(replicas, [prefix + tail], f"then-{i}"))
        hits = [after - b for after, b in zip(hit_tokens(replicas), before)]
        assert hits[served] == 2 * 64 and hits[1 - served] == 0
    finally:
        replicas.shutdown()
        for e in engines:
            e.shutdown()


def test_replicas_give_one_engines_tokens(replicas, checkpoints) -> None:
    ckpt = checkpoints["llama"]
    single = LLM(str(ckpt.path), dtype="float32", max_num_batched_tokens=256)
    expected = [o.outputs[0].token_ids for o in single.generate(token_prompts(ckpt.prompts), GREEDY, use_tqdm=False)]
    assert asyncio.run(generate(replicas, ckpt.prompts, "all")) == expected
    assert min(replicas.router.routed) >= 4  # both replicas served


def test_a_prompt_goes_to_the_replica_that_caches_its_prefix(replicas, checkpoints) -> None:
    prompts = checkpoints["llama"].prompts  # 10 and 11 share their first 150 tokens with 8
    asyncio.run(generate(replicas, [prompts[8]], "first"))
    served = replicas.router.routed.index(1)
    for i in (10, 11, 3):  # one at a time: each finds the replicas idle
        asyncio.run(generate(replicas, [prompts[i]], f"then-{i}"))
    hits = hit_tokens(replicas)
    assert hits[served] == 2 * 144 and hits[1 - served] == 0  # 9 whole blocks of 16, twice
    assert replicas.router.routed[served] == 3  # prompt 3 shares nothing: the other replica, in turn


def test_requests_that_arrive_together_with_a_shared_prefix_meet_at_one_replica(replicas, checkpoints) -> None:
    prompts = checkpoints["llama"].prompts
    asyncio.run(generate(replicas, [prompts[8], prompts[3], prompts[10], prompts[11]], "together"))
    assert sorted(replicas.router.routed) == [1, 3]
    assert sorted(hit_tokens(replicas)) == [0, 2 * 144]


def test_data_parallel_is_refused_where_it_cannot_work(checkpoints, monkeypatch) -> None:
    path = str(checkpoints["llama"].path)
    with pytest.raises(ValueError, match="data_parallel_size=2: replicas serve together behind `dabba serve"):
        LLM(path, data_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1"):
        LLM(path, data_parallel_size=0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(ValueError, match=r"data_parallel_size=2 x tensor_parallel_size=2 = 4 ranks is more than the 2"):
        build_replicas(EngineConfig.from_kwargs(model=path, data_parallel_size=2, tensor_parallel_size=2))


def metric(text: str, name: str, replica: str) -> float:
    return float(re.search(rf'^{re.escape(name)}{{model_name="tiny",replica="{replica}"}} (\S+)$', text, re.M).group(1))


def test_the_server_routes_reports_each_replica_and_stops_when_one_dies(checkpoints) -> None:
    with live_server(str(checkpoints["llama"].path), "tiny", None, data_parallel_size=2) as (url, engines):
        for prompt in ("hello", "goodbye"):  # two prompts without a whole block: one to each replica, in turn
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        text = httpx.get(f"{url}/metrics").text
        name = "dabba:generation_tokens_total"
        assert metric(text, name, "0") == metric(text, name, "1") == 4 and metric(text, name, "all") == 8
        assert metric(text, "dabba:kv_cache_usage_perc", "all") == 0.0
        snapshot = httpx.get(f"{url}/engine/stats").json()
        assert len(snapshot["replicas"]) == 2 and snapshot["generated_tokens"] == 8
        assert snapshot["kv"]["blocks"] == sum(e.engine_core.kv_cache_manager.num_usable_blocks for e in engines)
        assert httpx.get(f"{url}/health").status_code == 200

        engines[1].engine_core.executor.procs[0].kill()  # replica 1's worker: the next request there fails
        codes = [httpx.post(f"{url}/v1/completions", json={**body, "prompt": p}, timeout=60).status_code
                 for p in ("one", "two")]  # in turn: one of them goes to replica 1
        assert 503 in codes
        assert httpx.get(f"{url}/health").status_code == 503


def test_the_dashboard_watches_every_replica(replicas, replica_engines) -> None:
    async def first() -> tuple[dict, list[int]]:
        stream = replicas.watch_stats()
        snapshot = await anext(stream)
        watching = [r.feed.watchers for r in replicas.replicas]
        await stream.aclose()
        return snapshot, watching

    snapshot, watching = asyncio.run(first())
    assert watching == [1, 1] and [r.feed.watchers for r in replicas.replicas] == [0, 0]
    blocks = [e.engine_core.kv_cache_manager.num_usable_blocks for e in replica_engines]
    assert snapshot["kv"]["blocks"] == len(snapshot["kv"]["grid"]) == sum(blocks)
    assert [r["running"] for r in snapshot["replicas"]] == [0, 0]
