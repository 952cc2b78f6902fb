"""KV-cache groups: layers grouped by attention kind, sliding-window groups freeing the blocks
their window has passed, prefix hits that serve every group, and a scheduler that admits a
sequence longer than the cache could hold whole. Block size 4 throughout; block 0 is the null
block wherever a group slides."""
from __future__ import annotations

import pytest

from dabba.core.kv_cache_groups import KVCacheGroup, group_layers, group_size, layer_slots
from dabba.core.kv_cache_manager import KVCacheManager
from dabba.core.request import Request, RequestStatus
from tests.core.test_kv_cache_manager import fresh_tokens, make_request
from tests.core.test_scheduler import FakeWorker, make_scheduler, run_step
from tests.core.test_scheduler import make_request as make_scheduler_request

BS = 4
FULL = KVCacheGroup((0,), None)
SLIDING = KVCacheGroup((1,), 6)  # a query sees itself and the 5 keys before it


def gemma3_windows(num_layers: int = 26, window: int = 512) -> list[int | None]:
    """Gemma 3: every 6th layer global, the rest sliding."""
    return [None if (i + 1) % 6 == 0 else window for i in range(num_layers)]


def test_gemma3_1b_layers_group_in_fours_full_first() -> None:
    groups = group_layers(gemma3_windows())
    assert groups[0] == KVCacheGroup((5, 11, 17, 23), None)
    assert [g.layer_ids for g in groups[1:]] == [(0, 1, 2, 3), (4, 6, 7, 8), (9, 10, 12, 13), (14, 15, 16, 18),
                                                 (19, 20, 21, 22), (24, 25)]
    assert all(g.sliding_window == 512 for g in groups[1:])
    assert group_size(groups) == 4
    slots = layer_slots(groups)
    assert slots[5] == (0, 0) and slots[25] == (6, 1) and sorted(slots) == list(range(26))


@pytest.mark.parametrize("windows, expected", [
    ([None] * 3, [KVCacheGroup((0, 1, 2), None)]),  # Llama: one table, as without groups
    ([40] * 3, [KVCacheGroup((0, 1, 2), 40)]),  # Mistral
    ([40, None, 40, None], [KVCacheGroup((1, 3), None), KVCacheGroup((0, 2), 40)]),  # Gemma 2
    ([None, None, None, 8], [KVCacheGroup((0,), None), KVCacheGroup((1,), None), KVCacheGroup((2,), None),
                             KVCacheGroup((3,), 8)]),
])
def test_group_layers(windows, expected) -> None:
    assert group_layers(windows) == expected


@pytest.mark.parametrize("num_tokens, chunk, expected", [(3, 8, 1), (12, 8, 3), (40, 8, 5), (40, 1, 3), (400, 16, 7)])
def test_a_sliding_group_holds_the_window_behind_a_chunk(num_tokens, chunk, expected) -> None:
    # window 6 behind the chunk's first query: 5 keys + the chunk, over block edges
    assert SLIDING.blocks_needed(num_tokens, BS, chunk) == expected
    assert FULL.blocks_needed(num_tokens, BS, chunk) == -(-num_tokens // BS)


def table(kv: KVCacheManager, request_id: str, group: int) -> list[int]:
    return kv.get_block_ids(request_id)[group]


def compute(kv: KVCacheManager, request: Request, num_tokens: int, hits=None) -> tuple[list[int], ...]:
    new = kv.allocate_slots(request, num_tokens, hits)
    assert new is not None
    request.num_computed_tokens += num_tokens + (len(hits[0]) * BS if hits else 0)
    kv.check_integrity()
    return tuple([b.block_id for b in blocks] for blocks in new)


def evict(kv: KVCacheManager, block) -> None:
    """What taking a free cached block from the queue head does to the prefix cache."""
    del kv.pool.cached[block.block_hash]
    block.block_hash = None


def test_a_sliding_group_frees_what_its_window_has_passed() -> None:
    kv = KVCacheManager(16, BS, groups=(FULL, SLIDING))
    assert kv.num_usable_blocks == 15 and 0 not in kv.pool.free_queue
    a = make_request("a", fresh_tokens(10))
    assert compute(kv, a, 10) == ([1, 2, 3], [4, 5, 6])
    # Decoding token 10: its window (keys 5..10) has left block 0 (positions 0..3) behind.
    a.append_output_token(7)
    assert compute(kv, a, 1) == ([], [])
    assert table(kv, "a", 1) == [0, 5, 6]  # block 4 freed, the null block in its place
    assert kv.pool.blocks[4].ref_cnt == 0 and 4 in kv.pool.free_queue
    for token in range(8, 12):  # tokens 11..14: 12 opens a block in each group; 14 leaves positions 4..7
        a.append_output_token(token)
        compute(kv, a, 1)
    assert a.num_computed_tokens == 15
    assert table(kv, "a", 0) == [1, 2, 3, 7]
    assert table(kv, "a", 1) == [0, 0, 6, 8]
    # prefix caching keeps it reusable until evicted
    assert kv.pool.get_cached_block((1, a.block_hashes[0])) is kv.pool.blocks[4]
    kv.free(a)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == 15


def test_a_sliding_hit_needs_only_the_blocks_its_window_sees() -> None:
    kv = KVCacheManager(32, BS, groups=(SLIDING,))
    prompt = fresh_tokens(24)
    a = make_request("a", prompt)
    compute(kv, a, 24)
    kv.free(a)
    # b shares 22 tokens = 5 full blocks; its first computed token (20) sees keys 15..20: blocks 3, 4
    b = make_request("b", prompt[:22] + fresh_tokens(3))
    (hits,), num_hit = kv.get_computed_blocks(b)
    assert num_hit == 20 and [blk.block_id for blk in hits] == [0, 0, 0, 4, 5]
    assert compute(kv, b, 5, (hits,)) == ([7, 8],)
    assert table(kv, "b", 0) == [0, 0, 0, 4, 5, 7, 8]
    kv.free(b)
    # Evict block 4 (a's block 3): the run the window needs is broken, the hit moves back to
    # where two cached blocks end: blocks 1 and 2, 12 tokens.
    evict(kv, kv.pool.blocks[4])
    (hits,), num_hit = kv.get_computed_blocks(make_request("c", prompt[:22] + fresh_tokens(3)))
    assert num_hit == 12 and [blk.block_id for blk in hits] == [0, 2, 3]


def test_hybrid_hits_agree_across_groups() -> None:
    kv = KVCacheManager(32, BS, groups=(FULL, SLIDING))
    prompt = fresh_tokens(24)
    a = make_request("a", prompt)
    compute(kv, a, 24)
    kv.free(a)
    (full, sliding), num_hit = kv.get_computed_blocks(make_request("b", prompt + fresh_tokens(1)))
    assert num_hit == 24 and len(full) == len(sliding) == 6
    # The full group lost its block 2: every group's hit stops before it.
    evict(kv, kv.pool.get_cached_block((0, a.block_hashes[2])))
    (full, sliding), num_hit = kv.get_computed_blocks(make_request("c", prompt + fresh_tokens(1)))
    assert num_hit == 8 and len(full) == len(sliding) == 2


def test_a_sequence_longer_than_the_cache_runs_when_its_layers_slide() -> None:
    """12 usable blocks, a 50-token sequence: 13 blocks without freeing, never more than 5 with
    a 6-token window and 8-token chunks."""
    scheduler = make_scheduler(num_blocks=13, max_num_batched_tokens=8, groups=(KVCacheGroup((0, 1), 6),))
    worker = FakeWorker()
    a = make_scheduler_request("a", 30, max_tokens=20)
    scheduler.add_request(a)
    most = 0
    while scheduler.has_unfinished_requests():
        run_step(scheduler, worker)
        kv = scheduler.kv_cache_manager
        most = max(most, sum(1 for b in kv.get_block_ids("a")[0] if b != 0) if "a" in kv.req_to_blocks else 0)
    assert a.status == RequestStatus.FINISHED_LENGTH and len(a.output_token_ids) == 20
    assert most <= 5 and scheduler.num_preemptions == 0


def test_a_sequence_that_cannot_fit_is_refused_by_what_its_groups_hold() -> None:
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=8, groups=(FULL, SLIDING))
    # 47 tokens cached at most: 12 blocks in the full group, 5 in the sliding one (window + chunk)
    with pytest.raises(ValueError, match="needs 17 KV blocks but the cache has only 7"):
        scheduler.add_request(make_scheduler_request("a", 40, max_tokens=8))


def test_a_new_block_is_never_another_groups_hit() -> None:
    """Every group's hits leave the free queue before any group takes new blocks from its head:
    here the sliding group's hits (3, 4) are at the head when the full group needs a block."""
    kv = KVCacheManager(7, BS, groups=(FULL, SLIDING))
    prompt = fresh_tokens(8)
    a, c = make_request("a", prompt), make_request("c", fresh_tokens(4))
    assert compute(kv, a, 8) == ([1, 2], [3, 4])
    assert compute(kv, c, 4) == ([5], [6])
    kv.free(a)
    kv.free(c)
    assert list(kv.pool.free_queue) == [2, 1, 4, 3, 5, 6]
    b = make_request("b", prompt + fresh_tokens(1))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and [[blk.block_id for blk in h] for h in hits] == [[1, 2], [3, 4]]
    assert compute(kv, b, 1, hits) == ([5], [6])
    assert [b.ref_cnt for b in kv.pool.blocks[1:]] == [1] * 6
