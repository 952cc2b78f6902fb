"""The host-memory tier under the KV pool (core/kv_offload.py, worker/kv_offload.py): blocks the
pool evicts are kept and loaded back on a later prompt's miss, counted as cached tokens, with
greedy output identical to the engine without the tier; the tier's LRU order and bounds exactly."""
from __future__ import annotations

import pytest

from dabba import LLM, SamplingParams
from dabba.core.kv_cache_manager import KVCacheManager
from dabba.core.kv_offload import HostTierIndex, TierHit
from dabba.core.request import Request
from dabba.sampling_params import SamplingParams as Params
from tests.conftest import Checkpoint

BLOCK = 16 * 2 * 2 * 24 * 4 * 2  # the tiny Llama's block: 16 tokens, K and V, 2 KV heads of 24, float32, 2 layers


def test_index_is_an_lru_bounded_in_blocks() -> None:
    tier = HostTierIndex(3, 100)
    for block_id, key in enumerate("abc"):
        tier.evicted(block_id, key)
    assert tier.keys() == ["a", "b", "c"] and tier.bytes_held == 300
    tier.evicted(7, "b")  # held already: made most recent, not stored again
    tier.evicted(8, "d")  # full: the least recently used goes
    assert tier.keys() == ["c", "b", "d"] and tier.bytes_held == 300
    step = tier.take()
    assert step.drops == ["a"] and step.stores == [(0, "a"), (1, "b"), (2, "c"), (8, "d")] and step.loads == []
    tier.load("c", 5)  # pinned for this step: never dropped in it
    tier.evicted(9, "e")
    assert tier.keys() == ["d", "c", "e"]
    step = tier.take()
    assert (step.drops, step.stores, step.loads) == (["b"], [(9, "e")], [("c", 5)])
    tier.load("d", 1), tier.load("c", 2), tier.load("e", 3)
    tier.evicted(4, "f")  # every key is being loaded: this block is not kept
    assert "f" not in tier and tier.take().stores == []
    assert tier.take() is None  # a step with nothing to copy
    assert (tier.stats.stored_blocks, tier.stats.loaded_blocks, tier.stats.dropped_blocks) == (5, 4, 2)
    tier.clear()
    assert len(tier) == 0 and sorted(tier.take().drops) == ["c", "d", "e"]


def request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, Params(max_tokens=4), block_size=4)


def test_a_miss_in_the_pool_loads_the_tiers_run_into_fresh_blocks() -> None:
    kv = KVCacheManager(6, 4, tier=HostTierIndex(8, 1))
    first = request("a", list(range(13)))  # 3 full blocks before its last token
    hits, n = kv.get_computed_blocks(first)
    assert n == 0
    kv.allocate_slots(first, 13, hits)
    kv.free(first)
    kv.take_transfers()
    other = request("b", list(range(100, 121)))  # takes all 6 blocks: first's 3 cached ones go
    kv.allocate_slots(other, 21, kv.get_computed_blocks(other)[0])
    stored = kv.take_transfers().stores
    assert [key for _, key in stored] == [(0, h) for h in first.block_hashes[2::-1]]  # freed last block first
    kv.free(other)
    again = request("c", list(range(13)))
    hits, n = kv.get_computed_blocks(again)
    assert n == 12 and all(isinstance(h, TierHit) for h in hits[0])
    assert kv.allocate_slots(again, 1, hits) is not None
    loads = kv.take_transfers().loads
    assert [key for key, _ in loads] == [(0, h) for h in again.block_hashes[:3]]
    assert [block for _, block in loads] == kv.get_block_ids("c")[0][:3]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_evicted_prefixes_come_back_from_host_memory_with_identical_output(checkpoints, kv_cache_dtype) -> None:
    llama: Checkpoint = checkpoints["llama"]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    order = (8, 9, 7, 6, 8, 9)  # 8 and 9 again once the others have pushed them out of a 30-block pool
    block = BLOCK if kv_cache_dtype == "auto" else BLOCK // 4 + 16 * 2 * 2 * 4 * 2  # codes + a scale per token and head
    cached = {}
    for tier in (None, 64 * block):
        llm = LLM(str(llama.path), dtype="float32", kv_cache_memory=30 * block, kv_offload_memory=tier,
                  kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=64)
        outs = [llm.generate({"prompt_token_ids": llama.prompts[k]}, params, use_tqdm=False)[0] for k in order]
        cached[tier is not None] = [o.num_cached_tokens for o in outs]
        if tier is not None:
            stats = llm.get_stats()
            hits = stats.kv_offload_memory_hit_blocks
            assert hits > 0 and stats.kv_offload_memory_loaded_bytes == hits * block
            assert stats.kv_offload_memory_stored_bytes >= stats.kv_offload_memory_bytes > 0
            assert stats.kv_offload_memory_bytes <= 64 * block
            assert llm.reset_prefix_cache() and llm.get_stats().kv_offload_memory_bytes == 0
        if kv_cache_dtype == "auto":
            assert [o.outputs[0].token_ids for o in outs] == [llama.reference[k][:16] for k in order]
        else:
            outputs = [o.outputs[0].token_ids for o in outs]
            assert outputs[4] == outputs[0] and outputs[5] == outputs[1]  # the same codes, read back
    assert cached[False][4:] == [0, 64]  # without the tier, little is left in the pool
    assert cached[True][4:] == [176, 288]  # every full block but the last token's, from pool and tier


def test_cache_reset_and_metrics_over_http(checkpoints) -> None:
    import httpx

    from tests.entrypoints.live_server import live_server

    llama: Checkpoint = checkpoints["llama"]
    headers = {"Authorization": "Bearer k"}
    with live_server(str(llama.path), "tiny", "k", kv_cache_memory=30 * BLOCK, kv_offload_memory=64 * BLOCK) as (url, _):
        for k in (8, 9, 7, 6):
            r = httpx.post(f"{url}/v1/completions", headers=headers, timeout=60,
                           json={"model": "tiny", "prompt": llama.prompts[k], "max_tokens": 2})
            assert r.status_code == 200
        metrics = httpx.get(f"{url}/metrics").text
        held = next(line for line in metrics.splitlines() if line.startswith("dabba:kv_offload_memory_bytes{"))
        assert float(held.split()[-1]) > 0 and "dabba:kv_offload_memory_stored_bytes_total" in metrics
        assert httpx.post(f"{url}/cache/reset").status_code == 401
        r = httpx.post(f"{url}/cache/reset", headers=headers)
        assert r.status_code == 200 and r.json() == {"reset": ["tiny"]}
        assert httpx.post(f"{url}/cache/reset", headers=headers, json={"model": "other"}).status_code == 404
        metrics = httpx.get(f"{url}/metrics").text
        held = next(line for line in metrics.splitlines() if line.startswith("dabba:kv_offload_memory_bytes{"))
        assert float(held.split()[-1]) == 0


def test_disk_index_bounds_and_concurrent_fetches_ask_once() -> None:
    from dabba.core.kv_offload import DiskTierIndex

    disk = DiskTierIndex(3, ["old", "a", "b", "c"])  # a directory holding more than the bound: the oldest go
    assert disk.keys() == ["a", "b", "c"] and disk.evicted_at_start == ["old"]
    assert disk.add("d") == ["a"] and disk.keys() == ["b", "c", "d"]
    tier = HostTierIndex(4, 10, disk)
    assert tier.take().deletes == ["old"]
    assert tier.fetching([], ["b", "c", "x"]) is True  # b and c on disk: fetched, the prompt waits
    assert tier.fetching([], ["b", "c", "x"]) is True  # a second prompt over them waits for the same reads
    assert tier.take().fetches == ["b", "c"]
    assert disk.add("e") == ["d"]  # blocks on their way are never the disk's victims
    tier.fetched(["b"], ["c"])  # c's file failed its checks: recomputed, forgotten
    assert "b" in tier and "c" not in disk and tier.fetching(["b"], ["x"]) is False


def disk_run(llama: Checkpoint, directory, order: tuple[int, ...]) -> tuple[list, object]:
    llm = LLM(str(llama.path), dtype="float32", kv_cache_memory=30 * BLOCK, kv_offload_memory=16 * BLOCK,
              kv_offload_dir=str(directory), max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = [llm.generate({"prompt_token_ids": llama.prompts[k]}, params, use_tqdm=False)[0] for k in order]
    llm.llm_engine.engine_core.model_runner.host_tier.disk.flush()  # every write asked for is on disk
    assert [o.outputs[0].token_ids for o in outs] == [llama.reference[k][:16] for k in order]
    return [o.num_cached_tokens for o in outs], llm.get_stats()


def test_the_disk_tier_serves_a_restart_and_recomputes_bad_files(checkpoints, tmp_path) -> None:
    import json
    import struct

    from dabba.worker.kv_offload import MAGIC

    llama: Checkpoint = checkpoints["llama"]
    cached, stats = disk_run(llama, tmp_path, (8, 9, 7, 6))
    assert cached == [0, 0, 0, 0] and stats.kv_offload_disk_bytes > 0
    (model_dir,) = tmp_path.iterdir()
    files = {f.name for f in model_dir.iterdir()}
    assert stats.kv_offload_disk_bytes == len(files) * BLOCK  # every full block computed, once
    cached, stats = disk_run(llama, tmp_path, (8,))  # a restart: the prefix comes from disk
    assert cached == [176] and stats.kv_offload_disk_hit_blocks == 11

    from dabba.core.request import Request

    hashes = Request("x", llama.prompts[9], Params(max_tokens=1), block_size=16).prefix_block_hashes
    paths = [model_dir / f"{h.hex()}.kv" for h in hashes]
    data = paths[2].read_bytes()
    paths[2].write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # a flipped bit: the checksum fails
    size = struct.unpack("<I", data[len(MAGIC):len(MAGIC) + 4])[0]
    header = json.loads(data[len(MAGIC) + 4:len(MAGIC) + 4 + size])
    foreign = json.dumps({**header, "model": "0" * 32}).encode()
    paths[5].write_bytes(MAGIC + struct.pack("<I", len(foreign)) + foreign + data[len(MAGIC) + 4 + size:])
    paths[7].write_bytes(paths[7].read_bytes()[:100])  # truncated
    (model_dir / "leftover.kv.tmp123").write_bytes(b"half")  # an interrupted write
    cached, stats = disk_run(llama, tmp_path, (9,))  # equal output all the same, recomputed from block 2 on
    assert cached == [32] and stats.kv_offload_disk_failed_blocks == 3
    assert not (model_dir / "leftover.kv.tmp123").exists()
    cached, stats = disk_run(llama, tmp_path, (9,))  # the recomputed blocks were written again, good ones
    assert cached == [16 * 16] and stats.kv_offload_disk_failed_blocks == 0  # as many as memory keeps
