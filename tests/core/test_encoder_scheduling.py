"""The encoder budget and cache in the scheduler (torch-free): where chunks stop for images, which
step encodes each image, what the cache keeps and evicts, and how images key prefix-cache blocks.
Block size 4; every step runs through tests/core/test_scheduler.py's FakeWorker and checks."""
from __future__ import annotations

import pytest

from dabba.config import SchedulerConfig
from dabba.core.encoder_cache import EncoderCache
from dabba.core.encoder_scheduling import EncoderScheduler
from dabba.core.kv_cache_manager import KVCacheManager
from dabba.core.multimodal import MultiModalFeature, PlaceholderRange
from dabba.core.request import Request
from dabba.core.scheduler import Scheduler
from dabba.errors import InvalidRequest
from tests.core.test_scheduler import BLOCK_SIZE, FakeWorker, make_request, run_step

IMAGE = 99  # placeholder token id


def image_scheduler(max_num_batched_tokens: int = 16, budget: int = 16, cache_rows: int = 64,
                    whole_items: bool = True) -> Scheduler:
    kv = KVCacheManager(64, BLOCK_SIZE, True, None, max_num_batched_tokens)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens)
    encoder = EncoderScheduler(budget, EncoderCache(cache_rows), whole_items, max_num_batched_tokens)
    return Scheduler(config, kv, 256, encoder=encoder)


def image_request(request_id: str, layout: list[int | str], max_tokens: int = 2) -> Request:
    """``layout``: text token ids, and "name:length" for an image of that many placeholders."""
    prompt, features = [], []
    for part in layout:
        if isinstance(part, str):
            name, length = part.split(":")
            features.append(MultiModalFeature(name, PlaceholderRange(len(prompt), int(length))))
            prompt += [IMAGE] * int(length)
        else:
            prompt.append(part)
    request = make_request(request_id, prompt, max_tokens)
    request.mm_features = features
    request.block_hashes.clear()
    request.__post_init__()  # hashed with its images
    return request


def test_chunks_stop_before_an_image_they_cannot_take_whole() -> None:
    """10-token steps over | 6 text | image a (8) | 3 text |: the first chunk stops at the image
    (6 tokens, not 10), the second takes the image whole and encodes it, the third the rest."""
    scheduler, worker = image_scheduler(max_num_batched_tokens=10), FakeWorker()
    scheduler.add_request(image_request("r", [1, 2, 3, 4, 5, 6, "a:8", 7, 8, 9]))
    steps = []
    for _ in range(3):
        out, _ = run_step(scheduler, worker)
        steps.append((out.num_scheduled_tokens["r"], out.scheduled_encoder_inputs))
    assert steps == [(6, {}), (10, {"r": [0]}), (1, {})]
    assert scheduler.encoder.num_encoded == 1


def test_causal_images_may_be_cut_and_stay_cached_until_passed() -> None:
    """Without whole_items a chunk cuts through the image; its embeddings, encoded with the first
    chunk, stay referenced until the request computes past them."""
    scheduler, worker = image_scheduler(max_num_batched_tokens=10, whole_items=False), FakeWorker()
    scheduler.add_request(image_request("r", [1, 2, 3, 4, 5, 6, "a:8", 7]))
    out, _ = run_step(scheduler, worker)
    assert (out.num_scheduled_tokens["r"], out.scheduled_encoder_inputs) == (10, {"r": [0]})
    assert scheduler.encoder.cache.entries["a"].request_ids == {"r"}
    out, _ = run_step(scheduler, worker)
    assert (out.num_scheduled_tokens["r"], out.scheduled_encoder_inputs) == (5, {})
    assert scheduler.encoder.cache.unreferenced == {"a": 8}  # passed: kept, evictable


def test_the_encoder_budget_spreads_images_over_steps_while_decodes_run() -> None:
    """An 8-row budget: two requests with an 8-token image each encode one a step; the second
    waits for the next step's budget while the first's tokens run."""
    scheduler, worker = image_scheduler(max_num_batched_tokens=32, budget=8), FakeWorker()
    scheduler.add_request(image_request("a", [1, "x:8", 2]))
    scheduler.add_request(image_request("b", [3, "y:8", 4]))
    out, _ = run_step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 10, "b": 1} and out.scheduled_encoder_inputs == {"a": [0]}
    out, _ = run_step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9} and out.scheduled_encoder_inputs == {"b": [0]}


def test_the_same_image_is_encoded_once_and_evicted_least_recently_used() -> None:
    """Room for two 4-row images: two requests showing image a in one step encode it once; a
    later request shows b, then c, which evicts a (unreferenced, least recently used); the
    eviction reaches the worker with the next step."""
    scheduler, worker = image_scheduler(cache_rows=8), FakeWorker()
    scheduler.add_request(image_request("r1", [1, "a:4", 2]))
    scheduler.add_request(image_request("r2", [5, 6, "a:4", 7]))
    out, _ = run_step(scheduler, worker)
    assert out.scheduled_encoder_inputs == {"r1": [0]}
    while scheduler.has_unfinished_requests():
        run_step(scheduler, worker)
    for rid, name in (("r3", "b"), ("r4", "c")):
        scheduler.add_request(image_request(rid, [8, f"{name}:4", 9]))
        out, _ = run_step(scheduler, worker)
        assert out.scheduled_encoder_inputs == {rid: [0]}
    assert list(scheduler.encoder.cache.entries) == ["b", "c"]
    out, _ = run_step(scheduler, worker)
    assert out.free_encoder_hashes == ["a"]
    assert scheduler.get_stats().num_images_encoded == 3


def test_an_image_the_cache_has_no_room_for_waits() -> None:
    """Room for one 4-row image, held by a running request that has not passed it: a second
    request's different image waits (no tokens) until the first request's chunk is done."""
    scheduler, worker = image_scheduler(cache_rows=4, max_num_batched_tokens=16, whole_items=False), FakeWorker()
    scheduler.add_request(image_request("r1", [1, 2, "a:4", 3], max_tokens=1))
    scheduler.add_request(image_request("r2", [4, "b:4", 5], max_tokens=1))
    out, _ = run_step(scheduler, worker)
    assert out.num_scheduled_tokens == {"r1": 7, "r2": 1}  # r2 stops before its image
    assert out.scheduled_encoder_inputs == {"r1": [0]}
    out, _ = run_step(scheduler, worker)
    assert out.scheduled_encoder_inputs == {"r2": [0]} and out.free_encoder_hashes == []
    out, _ = run_step(scheduler, worker)
    assert out.free_encoder_hashes == ["a"]


def test_image_hashes_key_prefix_blocks() -> None:
    """Equal placeholder ids with different images hash to different blocks: no prefix hit; the
    same image hits, and its request encodes nothing."""
    text = [1, 2, 3, 4]
    assert (image_request("x", [*text, "a:4", 5]).block_hashes[1] != image_request("y", [*text, "b:4", 5]).block_hashes[1])
    assert image_request("x", [*text, "a:4", 5]).block_hashes == image_request("y", [*text, "a:4", 5]).block_hashes
    scheduler, worker = image_scheduler(), FakeWorker()
    scheduler.add_request(image_request("first", [*text, "a:4", 5, 6, 7, 8, 9]))
    while scheduler.has_unfinished_requests():
        run_step(scheduler, worker)
    scheduler.encoder.cache.entries.clear()  # forget the embeddings: only the prefix cache can serve
    scheduler.encoder.cache.unreferenced.clear()
    scheduler.encoder.cache.num_used = 0
    for rid, image, hit, encoded in (("same", "a", 12, {}), ("other", "b", 4, {"other": [0]})):
        scheduler.add_request(image_request(rid, [*text, f"{image}:4", 5, 6, 7, 8, 9]))
        out, _ = run_step(scheduler, worker)
        assert scheduler.requests[rid].num_cached_tokens == hit and out.scheduled_encoder_inputs == encoded


def test_images_that_could_never_run_are_refused() -> None:
    scheduler = image_scheduler(max_num_batched_tokens=8, budget=16, cache_rows=32)
    with pytest.raises(InvalidRequest, match="max_num_batched_tokens"):
        scheduler.add_request(image_request("r", [1, "a:12"]))
    with pytest.raises(InvalidRequest, match="encoder budget"):
        image_scheduler(budget=4).add_request(image_request("r", [1, "a:8"]))
    with pytest.raises(InvalidRequest, match="encoder cache"):
        image_scheduler(cache_rows=4).add_request(image_request("r", [1, "a:8"]))
    kv = KVCacheManager(64, BLOCK_SIZE, True, None, 16)
    with pytest.raises(InvalidRequest, match="takes no images") as e:
        Scheduler(SchedulerConfig(), kv, 256).add_request(image_request("r", [1, "a:4"]))
    assert e.value.param == "multi_modal_data"


def test_a_cached_image_a_chunk_reads_is_not_evicted_to_make_room() -> None:
    """Room for two 4-row images, a kept unreferenced: a request showing a, b and c encodes b in
    a's company (a pinned, not evicted) and stops before c, which waits for the room a frees."""
    scheduler, worker = image_scheduler(cache_rows=8, max_num_batched_tokens=32), FakeWorker()
    scheduler.add_request(image_request("first", [1, "a:4", 2], max_tokens=1))
    while scheduler.has_unfinished_requests():
        run_step(scheduler, worker)
    assert scheduler.encoder.cache.unreferenced == {"a": 4}
    scheduler.add_request(image_request("r", [3, "a:4", 4, "b:4", 5, "c:4", 6], max_tokens=1))
    out, _ = run_step(scheduler, worker)
    assert out.num_scheduled_tokens == {"r": 11} and out.scheduled_encoder_inputs == {"r": [1]}
    out, _ = run_step(scheduler, worker)
    assert out.scheduled_encoder_inputs == {"r": [2]} and out.free_encoder_hashes == []
    out, _ = run_step(scheduler, worker)
    assert out.free_encoder_hashes == ["a"]
