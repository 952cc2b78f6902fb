"""The encoder budget and cache in the scheduler (torch-free): where chunks stop for images, which
step encodes each image, what the cache keeps and evicts, and how images key prefix-cache blocks.
Block size 4; every step runs through tests/core/test_scheduler.py's FakeWorker and checks."""
from __future__ import annotations

from typing import Callable

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


def started(out) -> dict[str, list[str]]:
    """The images whose encodings a step starts, by request."""
    return {rid: [f.identifier for f in features] for rid, features in out.scheduled_encoder_inputs.items()}


def test_chunks_stop_before_an_image_they_cannot_take_whole() -> None:
    """10-token steps over | 6 text | image a (8) | 3 text |: the first chunk stops at the image
    (6 tokens, not 10), the second takes the image whole and encodes it, the third the rest."""
    scheduler, worker = image_scheduler(max_num_batched_tokens=10), FakeWorker()
    scheduler.add_request(image_request("r", [1, 2, 3, 4, 5, 6, "a:8", 7, 8, 9]))
    steps = []
    for _ in range(3):
        out, _ = run_step(scheduler, worker)
        steps.append((out.num_scheduled_tokens["r"], started(out)))
    assert steps == [(6, {}), (10, {"r": ["a"]}), (1, {})]
    assert scheduler.encoder.num_encoded == 1


def test_causal_images_may_be_cut_and_stay_cached_until_passed() -> None:
    """Without whole_items a chunk cuts through the image; its embeddings, encoded with the first
    chunk, stay referenced until the request computes past them."""
    scheduler, worker = image_scheduler(max_num_batched_tokens=10, whole_items=False), FakeWorker()
    scheduler.add_request(image_request("r", [1, 2, 3, 4, 5, 6, "a:8", 7]))
    out, _ = run_step(scheduler, worker)
    assert (out.num_scheduled_tokens["r"], started(out)) == (10, {"r": ["a"]})
    assert scheduler.encoder.cache.entries["a"].request_ids == {"r"}
    out, _ = run_step(scheduler, worker)
    assert (out.num_scheduled_tokens["r"], started(out)) == (5, {})
    assert scheduler.encoder.cache.unreferenced == {"a": 8}  # passed: kept, evictable


def test_the_encoder_budget_spreads_images_over_steps_while_decodes_run() -> None:
    """An 8-row budget: two requests with an 8-token image each encode one a step; the second
    waits for the next step's budget while the first's tokens run."""
    scheduler, worker = image_scheduler(max_num_batched_tokens=32, budget=8), FakeWorker()
    scheduler.add_request(image_request("a", [1, "x:8", 2]))
    scheduler.add_request(image_request("b", [3, "y:8", 4]))
    out, _ = run_step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 10, "b": 1} and started(out) == {"a": ["x"]}
    out, _ = run_step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9} and started(out) == {"b": ["y"]}


def test_the_same_image_is_encoded_once_and_evicted_least_recently_used() -> None:
    """Room for two 4-row images: two requests showing image a in one step encode it once; a
    later request shows b, then c, which evicts a (unreferenced, least recently used); the
    eviction reaches the worker with the next step."""
    scheduler, worker = image_scheduler(cache_rows=8), FakeWorker()
    scheduler.add_request(image_request("r1", [1, "a:4", 2]))
    scheduler.add_request(image_request("r2", [5, 6, "a:4", 7]))
    out, _ = run_step(scheduler, worker)
    assert started(out) == {"r1": ["a"]}
    while scheduler.has_unfinished_requests():
        run_step(scheduler, worker)
    for rid, name in (("r3", "b"), ("r4", "c")):
        scheduler.add_request(image_request(rid, [8, f"{name}:4", 9]))
        out, _ = run_step(scheduler, worker)
        assert started(out) == {rid: [name]}
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
    assert started(out) == {"r1": ["a"]}
    out, _ = run_step(scheduler, worker)
    assert started(out) == {"r2": ["b"]} and out.free_encoder_hashes == []
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
    for rid, image, hit, encoded in (("same", "a", 12, {}), ("other", "b", 4, {"other": ["b"]})):
        scheduler.add_request(image_request(rid, [*text, f"{image}:4", 5, 6, 7, 8, 9]))
        out, _ = run_step(scheduler, worker)
        assert scheduler.requests[rid].num_cached_tokens == hit and started(out) == encoded


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
    assert out.num_scheduled_tokens == {"r": 11} and started(out) == {"r": ["b"]}
    out, _ = run_step(scheduler, worker)
    assert started(out) == {"r": ["c"]} and out.free_encoder_hashes == []
    out, _ = run_step(scheduler, worker)
    assert out.free_encoder_hashes == ["a"]


DECODE_S, UNIT_S, TOKEN_S = 0.1, 0.0098, 0.0125  # a decode-only step, a unit of encoding, an image prompt token
UNIT_WORK = 1e9  # a unit's operations


class UnitEncoder(FakeWorker):
    """A FakeWorker whose images take ``units`` units of encoding each, run as the step allows:
    while their operations fit encoder_work (one at least), all (None), or none (0)."""

    def __init__(self, units: int) -> None:
        super().__init__()
        self.units = units
        self.left: dict[str, int] = {}  # encodings under way, oldest first

    def execute(self, out):
        runner_out = super().execute(out)
        for features in out.scheduled_encoder_inputs.values():
            for feature in features:
                self.left.setdefault(feature.identifier, self.units)
        budget = out.encoder_work
        while self.left and budget != 0:
            if budget is not None and runner_out.encoder_units and (runner_out.encoder_units + 1) * UNIT_WORK > budget:
                break
            identifier = next(iter(self.left))
            runner_out.encoder_units += 1
            self.left[identifier] -= 1
            if self.left[identifier] == 0:
                del self.left[identifier]
                runner_out.encoded_images.append(identifier)
        runner_out.encoder_work = UNIT_WORK * runner_out.encoder_units
        runner_out.encoder_seconds = UNIT_S * runner_out.encoder_units
        return runner_out


def rationed_scheduler(whole_items: bool) -> tuple[Scheduler, Callable[[], None], list[tuple]]:
    """A scheduler with image_decode_slowdown 1.5, a worker whose images take 12 units of
    encoding, a chat request decoding; a step function whose time is DECODE_S, UNIT_S a unit and
    TOKEN_S an image prompt token, and the steps' (chat tokens, whole units granted, units run,
    other requests' tokens)."""
    from dabba.core.image_budget import image_step_mix

    kv = KVCacheManager(64, BLOCK_SIZE, True, None, 64)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    encoder = EncoderScheduler(32, EncoderCache(64), whole_items, 64, decode_slowdown=1.5)
    scheduler, worker = Scheduler(config, kv, 256, encoder=encoder), UnitEncoder(12)
    scheduler.add_request(make_request("chat", list(range(100, 108)), 100))
    steps: list[tuple] = []

    def step() -> None:
        out = scheduler.schedule()
        mix = image_step_mix(out.num_scheduled_tokens, scheduler.requests)
        runner_out = worker.execute(out)
        scheduler.update_from_output(out, runner_out)
        scheduler.record_step_time(out, runner_out, DECODE_S + runner_out.encoder_seconds + TOKEN_S * mix[1])
        granted = None if out.encoder_work is None else int(out.encoder_work // UNIT_WORK)  # in whole units
        steps.append((out.num_scheduled_tokens.get("chat"), granted, runner_out.encoder_units,
                      sum(n for rid, n in out.num_scheduled_tokens.items() if rid != "chat")))

    step()  # the chat prompt: it decodes from here
    return scheduler, step, steps


def test_image_work_is_rationed_while_requests_decode() -> None:
    """A chat request decodes while an image request (an image of 12 units of encoding) arrives,
    with image_decode_slowdown 1.5: the first step runs the decodes alone (their time), the next
    one unit (its price), then 0.5 x DECODE_S / UNIT_S = 5.1 units' operations a step (5 run)
    until the encoding ends;
    then the image request's prompt FIRST_TOKENS tokens, then 0.5 x DECODE_S / TOKEN_S = 4 a
    step. The chat request decodes every step; with nothing decoding, the image runs whole."""
    from dabba.core.pooling_budget import FIRST_TOKENS

    scheduler, step, steps = rationed_scheduler(whole_items=False)
    scheduler.add_request(image_request("image", [1, 2, "a:8", *range(3, 13)], max_tokens=4))
    for _ in range(7):
        step()
    assert steps[1:] == [(1, 0, 0, 0), (1, 0, 1, 0), (1, 5, 5, 0), (1, 5, 5, 0), (1, 5, 1, 0),
                         (1, 0, 0, FIRST_TOKENS), (1, 0, 0, 4)]
    assert scheduler.requests["image"].num_computed_tokens == 20  # its prompt, done: it decodes
    scheduler.abort_request("chat")
    scheduler.abort_request("image")
    scheduler.add_request(image_request("alone", [1, 2, "b:8", 3], max_tokens=1))
    step()
    assert steps[-1] == (None, None, 12, 11)  # nothing decodes: encoded whole, its tokens in the same step


def test_an_image_that_runs_whole_waits_for_enough_tokens_granted() -> None:
    """Gemma 3's images run in one chunk: a 24-token image waits while the 4 tokens a step
    granted add up (16 at first, 2 of them taken by the text before it), then runs whole."""
    scheduler, step, steps = rationed_scheduler(whole_items=True)
    scheduler.add_request(image_request("image", [1, 2, "a:24", 3, 4], max_tokens=4))
    for _ in range(10):
        step()
    assert [s[3] for s in steps[6:]] == [2, 0, 0, 26, 1]  # credit 16 -> 14 + 4 + 4 + 4 = 26; then it decodes
    assert all(s[0] == 1 for s in steps[1:])
