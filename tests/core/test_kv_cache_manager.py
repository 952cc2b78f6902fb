"""KVCacheManager: block tables over the pool, prefix hits and the order blocks are freed in.

Block size 4 throughout. Each test drives the manager the way the scheduler does: a prefix hit
on admission, ``allocate_slots`` for the tokens computed this step, ``free`` at the end.
"""
from __future__ import annotations

import itertools

import pytest

from dabba.core.kv_cache_manager import KVCacheManager
from dabba.core.request import Request
from dabba.sampling_params import SamplingParams

BLOCK_SIZE = 4
_fresh_token = itertools.count(10_000)


def fresh_tokens(n: int) -> list[int]:
    """Token ids no other call returns: no accidental prefix sharing between requests."""
    return [next(_fresh_token) for _ in range(n)]


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=16), block_size=BLOCK_SIZE)


def ids(blocks) -> list[int]:
    """Block ids of a list of blocks, or of the one group's list in a per-group tuple."""
    if isinstance(blocks, tuple):
        (blocks,) = blocks
    return [b.block_id for b in blocks]


def prefill(kv: KVCacheManager, request: Request) -> tuple[list[int], list[int]]:
    """Admit the request and compute its whole prompt in one step; returns (hit ids, new ids)."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert num_hit == len(ids(hits)) * BLOCK_SIZE
    new_blocks = kv.allocate_slots(request, request.num_tokens - num_hit, hits)
    assert new_blocks is not None
    request.num_computed_tokens = request.num_tokens
    kv.check_integrity()
    return ids(hits), ids(new_blocks)


def decode(kv: KVCacheManager, request: Request, token_id: int) -> list[int] | None:
    """Append the token sampled last step and make room to compute it; returns new block ids."""
    request.append_output_token(token_id)
    new_blocks = kv.allocate_slots(request, 1)
    if new_blocks is not None:
        request.num_computed_tokens += 1
    kv.check_integrity()
    return None if new_blocks is None else ids(new_blocks)


def free_queue_ids(kv: KVCacheManager) -> list[int]:
    return list(kv.pool.free_queue)


def ref_cnts(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def hit_ids(kv: KVCacheManager, prompt: list[int]) -> list[int]:
    """Block ids a new request with this prompt would hit (a pure query: nothing changes)."""
    hits, num_hit = kv.get_computed_blocks(make_request("probe", prompt))
    assert num_hit == len(ids(hits)) * BLOCK_SIZE
    return ids(hits)


def snapshot(kv: KVCacheManager):
    """Everything allocate_slots may change."""
    return (
        free_queue_ids(kv),
        ref_cnts(kv),
        {h: b.block_id for (_, h), b in kv.pool.cached.items()},
        {rid: ids(blocks) for rid, blocks in kv.req_to_blocks.items()},
        {rid: list(n) for rid, n in kv.num_cached_blocks.items()},
        (kv.prefix_stats.num_queried_tokens, kv.prefix_stats.num_hit_tokens),
        kv.pool.num_evictions,
    )


# ---- allocation ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "num_tokens, expected_block_ids",
    [(1, [0]), (3, [0]), (4, [0]), (5, [0, 1]), (8, [0, 1]), (9, [0, 1, 2]), (12, [0, 1, 2]), (13, [0, 1, 2, 3])],
)
def test_allocate_slots_rounds_up_to_whole_blocks(num_tokens, expected_block_ids):
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", fresh_tokens(num_tokens))
    assert prefill(kv, request) == ([], expected_block_ids)
    assert kv.get_block_ids("a") == (expected_block_ids,)
    assert kv.pool.num_free_blocks == 8 - len(expected_block_ids)
    assert free_queue_ids(kv) == list(range(len(expected_block_ids), 8))


def test_decode_takes_a_new_block_only_when_crossing_a_block_boundary():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = make_request("a", fresh_tokens(5))
    assert prefill(kv, a) == ([], [0, 1])
    b = make_request("b", fresh_tokens(4))
    assert prefill(kv, b) == ([], [2])
    # a computes its 6th, 7th, 8th token in block 1; the 9th needs a block: the next free one is 3.
    assert [decode(kv, a, t) for t in (1, 2, 3, 4, 5)] == [[], [], [], [3], []]
    assert a.num_computed_tokens == 10
    assert kv.get_block_ids("a") == ([0, 1, 3],)
    assert kv.get_block_ids("b") == ([2],)
    assert kv.get_block_ids("unknown") == ([],)
    assert ref_cnts(kv) == [1, 1, 1, 1, 0, 0, 0, 0]


def test_allocate_slots_returns_none_when_blocks_are_short_and_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    a = make_request("a", fresh_tokens(8))
    assert prefill(kv, a) == ([], [0, 1])

    # A new request needing 3 blocks while 1 is free.
    before = snapshot(kv)
    b = make_request("b", fresh_tokens(9))
    assert kv.allocate_slots(b, 9) is None
    assert snapshot(kv) == before
    assert "b" not in kv.req_to_blocks

    # A running request that grows past the pool keeps what it has.
    assert decode(kv, a, 1) == [2]  # 9 tokens: the last free block
    for t in (2, 3, 4):
        assert decode(kv, a, t) == []  # 10..12 tokens
    a.append_output_token(5)  # 13 tokens: a 4th block, none free
    before = snapshot(kv)
    assert kv.allocate_slots(a, 1) is None
    assert snapshot(kv) == before
    assert kv.get_block_ids("a") == ([0, 1, 2],)
    kv.check_integrity()


# ---- prefix hits -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "num_tokens, expected_hit_ids",
    [(1, []), (4, []), (5, [0]), (8, [0]), (9, [0, 1]), (12, [0, 1]), (13, [0, 1, 2]), (14, [0, 1, 2])],
)
def test_prefix_hit_leaves_at_least_the_last_token_to_compute(num_tokens, expected_hit_ids):
    """A prompt of exactly k cached full blocks hits only k - 1: its last token gives the logits."""
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    base = fresh_tokens(14)
    assert prefill(kv, make_request("a", base[:12])) == ([], [0, 1, 2])
    before = snapshot(kv)
    request = make_request("b", base[:num_tokens])
    hits, num_hit = kv.get_computed_blocks(request)
    assert ids(hits) == expected_hit_ids
    assert num_hit == BLOCK_SIZE * len(expected_hit_ids)
    assert snapshot(kv) == before  # a query takes no reference


def test_shared_prefix_shares_block_ids_and_counts_hits_in_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    prefix = fresh_tokens(8)
    a = make_request("a", prefix + fresh_tokens(2))  # 10 tokens: 2 full blocks + 2
    b = make_request("b", prefix + fresh_tokens(3))  # 11 tokens
    assert prefill(kv, a) == ([], [0, 1, 2])
    assert prefill(kv, b) == ([0, 1], [3])
    assert kv.get_block_ids("b") == ([0, 1, 3],)
    assert ref_cnts(kv) == [2, 2, 1, 1, 0, 0, 0, 0]
    assert kv.prefix_stats.num_queried_tokens == 10 + 11
    assert kv.prefix_stats.num_hit_tokens == 8
    assert kv.prefix_stats.hit_rate == 8 / 21
    assert b.block_hashes[:2] == a.block_hashes[:2]
    assert free_queue_ids(kv) == [4, 5, 6, 7]


def test_reset_prefix_cache_is_refused_while_blocks_are_held_then_forgets_every_prefix():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = fresh_tokens(9)
    a = make_request("a", prompt)
    prefill(kv, a)
    assert hit_ids(kv, prompt) == [0, 1]
    assert kv.reset_prefix_cache() is False  # a holds blocks: nothing changes
    assert hit_ids(kv, prompt) == [0, 1]
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert hit_ids(kv, prompt) == []
    kv.check_integrity()
    assert prefill(kv, make_request("b", prompt))[0] == []  # computed in full


def test_hashes_chain_so_an_equal_block_after_a_different_prefix_does_not_hit():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first, second = fresh_tokens(4), fresh_tokens(4)
    prefill(kv, make_request("a", first + second + fresh_tokens(1)))
    assert hit_ids(kv, first + second + fresh_tokens(1)) == [0, 1]
    assert hit_ids(kv, fresh_tokens(4) + second + fresh_tokens(1)) == []
    assert hit_ids(kv, first + fresh_tokens(4) + fresh_tokens(1)) == [0]
    # The same second block after another first block has other KV: it is cached on its own,
    # and a later request with that prefix hits it, not a's block 1.
    other = fresh_tokens(4)
    assert prefill(kv, make_request("c", other + second + fresh_tokens(1))) == ([], [3, 4, 5])
    assert kv.pool.blocks[4].block_hash is not None
    assert hit_ids(kv, other + second + fresh_tokens(1)) == [3, 4]


def test_a_hit_is_a_run_of_leading_blocks_and_stops_at_the_first_miss():
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    prompt = fresh_tokens(9)
    a = make_request("a", prompt)
    assert prefill(kv, a) == ([], [0, 1, 2])
    kv.free(a)
    # Reorder the queue by hand so block 0 is evicted while block 1 is still cached.
    blocks = kv.pool.blocks
    kv.pool.touch([blocks[0], blocks[1]])
    kv.pool.free_blocks([blocks[0], blocks[1]])
    assert free_queue_ids(kv) == [3, 4, 2, 0, 1]
    for i in range(4):
        prefill(kv, make_request(f"filler{i}", fresh_tokens(4)))
    assert kv.pool.get_cached_block((0, a.block_hashes[0])) is None
    assert kv.pool.get_cached_block((0, a.block_hashes[1])) is blocks[1]
    assert hit_ids(kv, prompt) == []


def test_prefix_hits_on_unused_cached_blocks_take_them_out_of_the_free_count():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    prefix = fresh_tokens(8)
    a = make_request("a", prefix)
    assert prefill(kv, a) == ([], [0, 1])
    kv.free(a)
    assert free_queue_ids(kv) == [2, 3, 1, 0]  # 0 and 1 free but still cached
    x = make_request("x", fresh_tokens(8))
    assert prefill(kv, x) == ([], [2, 3])
    assert free_queue_ids(kv) == [1, 0]
    assert kv.pool.num_free_blocks == 2

    # 13 tokens: hits blocks 0 and 1 (both free), needs 2 more; only those 2 are free.
    b = make_request("b", prefix + fresh_tokens(5))
    hits, num_hit = kv.get_computed_blocks(b)
    assert (ids(hits), num_hit) == ([0, 1], 8)
    before = snapshot(kv)
    assert kv.allocate_slots(b, 5, hits) is None
    assert snapshot(kv) == before
    # 9 tokens: hits 0 and 1, needs 1 more: still none once the hits leave the queue.
    b9 = make_request("b9", prefix + fresh_tokens(1))
    hits9, _ = kv.get_computed_blocks(b9)
    assert kv.allocate_slots(b9, 1, hits9) is None
    assert snapshot(kv) == before

    # The prompt itself (8 tokens) hits block 0 only and recomputes block 1 into the last free
    # block, which is block 1: taking it evicts a's hash, then b8's identical block republishes it.
    b8 = make_request("b8", prefix)
    assert prefill(kv, b8) == ([0], [1])
    assert kv.pool.num_evictions == 1
    assert kv.pool.num_free_blocks == 0
    assert {h: blk.block_id for (_, h), blk in kv.pool.cached.items()} == {
        a.block_hashes[0]: 0, a.block_hashes[1]: 1, x.block_hashes[0]: 2, x.block_hashes[1]: 3}

    # Once x is gone, the 13-token request fits: its hits are held, so only 2 blocks are needed.
    kv.free(x)
    assert free_queue_ids(kv) == [3, 2]
    assert prefill(kv, b) == ([0, 1], [3, 2])
    assert kv.pool.num_evictions == 3
    assert kv.pool.num_free_blocks == 0
    assert ref_cnts(kv) == [2, 2, 1, 1]


def test_chunked_prefill_publishes_only_blocks_computed_by_the_end_of_the_chunk():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = fresh_tokens(10)
    a = make_request("a", prompt)
    assert ids(kv.allocate_slots(a, 6)) == [0, 1]  # tokens 0..5: block 0 full, block 1 half
    assert {h: blk.block_id for (_, h), blk in kv.pool.cached.items()} == {a.block_hashes[0]: 0}
    assert hit_ids(kv, prompt + fresh_tokens(1)) == [0]
    a.num_computed_tokens = 6
    assert ids(kv.allocate_slots(a, 4)) == [2]  # tokens 6..9
    a.num_computed_tokens = 10
    assert {h: blk.block_id for (_, h), blk in kv.pool.cached.items()} == {a.block_hashes[0]: 0, a.block_hashes[1]: 1}
    assert decode(kv, a, 1) == []  # token 10
    assert len(kv.pool.cached) == 2
    assert decode(kv, a, 2) == []  # token 11 fills block 2
    assert kv.pool.blocks[2].block_hash == (0, a.block_hashes[2])
    assert hit_ids(kv, prompt + [1, 2] + fresh_tokens(1)) == [0, 1, 2]


def test_a_duplicate_of_a_cached_block_stays_private():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    prompt = fresh_tokens(5)
    a, b = make_request("a", prompt), make_request("b", prompt)
    assert prefill(kv, a) == ([], [0, 1])
    # b computes the same prompt without using the hit (as if admitted before a was cached).
    assert ids(kv.allocate_slots(b, 5)) == [2, 3]
    assert kv.pool.get_cached_block((0, a.block_hashes[0])).block_id == 0
    assert kv.pool.blocks[2].block_hash is None
    kv.check_integrity()


def test_prefix_stats_count_once_per_admission():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = make_request("a", fresh_tokens(6))
    prefill(kv, a)
    decode(kv, a, 1)
    decode(kv, a, 2)  # 8 tokens: block 1 full and published
    assert (kv.prefix_stats.num_queried_tokens, kv.prefix_stats.num_hit_tokens) == (6, 0)
    # Readmitted (as after a preemption): queried again with its output, hitting its own blocks.
    kv.free(a)
    a.num_computed_tokens = 0
    assert prefill(kv, a) == ([0], [2])  # 8 tokens hit 1 block; the new one is the queue head
    assert (kv.prefix_stats.num_queried_tokens, kv.prefix_stats.num_hit_tokens) == (6 + 8, 4)


def test_without_caching_nothing_hits():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, enable_caching=False)
    prompt = fresh_tokens(9)
    a = make_request("a", prompt)
    assert prefill(kv, a) == ([], [0, 1, 2])
    assert kv.pool.cached == {}
    assert hit_ids(kv, prompt) == []
    kv.free(a)
    assert free_queue_ids(kv) == [3, 2, 1, 0]
    b = make_request("b", prompt)
    assert prefill(kv, b) == ([], [3, 2, 1])
    assert kv.pool.num_evictions == 0
    assert (kv.prefix_stats.num_queried_tokens, kv.prefix_stats.num_hit_tokens) == (18, 0)
    assert kv.prefix_stats.hit_rate == 0.0


# ---- free and eviction order -----------------------------------------------------------------

def test_free_releases_the_last_block_first_so_tails_are_evicted_before_the_prefix():
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    prompt = fresh_tokens(16)
    a = make_request("a", prompt)
    assert prefill(kv, a) == ([], [0, 1, 2, 3])
    kv.free(a)
    assert kv.req_to_blocks == {} and kv.num_cached_blocks == {}
    assert free_queue_ids(kv) == [4, 3, 2, 1, 0]
    assert ref_cnts(kv) == [0] * 5
    query = prompt + fresh_tokens(1)
    assert hit_ids(kv, query) == [0, 1, 2, 3]

    # One-block fillers take the queue head; a's blocks go tail first.
    taken, hits_after = [], []
    for i in range(5):
        taken += prefill(kv, make_request(f"filler{i}", fresh_tokens(4)))[1]
        hits_after.append(hit_ids(kv, query))
    assert taken == [4, 3, 2, 1, 0]
    assert hits_after == [[0, 1, 2, 3], [0, 1, 2], [0, 1], [0], []]
    assert kv.pool.num_evictions == 4


def test_a_shared_prefix_outlives_the_tails_of_the_requests_that_shared_it():
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    prefix, tail_a, tail_b = fresh_tokens(8), fresh_tokens(4), fresh_tokens(4)
    a = make_request("a", prefix + tail_a)
    b = make_request("b", prefix + tail_b)
    assert prefill(kv, a) == ([], [0, 1, 2])
    assert prefill(kv, b) == ([0, 1], [3])
    kv.free(a)
    assert free_queue_ids(kv) == [4, 5, 2]  # prefix blocks still held by b
    assert ref_cnts(kv) == [1, 1, 0, 1, 0, 0]
    kv.free(b)
    assert free_queue_ids(kv) == [4, 5, 2, 3, 1, 0]
    assert ref_cnts(kv) == [0] * 6

    query_a, query_b = prefix + tail_a + fresh_tokens(1), prefix + tail_b + fresh_tokens(1)
    taken, hits_after = [], []
    for i in range(6):
        taken += prefill(kv, make_request(f"filler{i}", fresh_tokens(4)))[1]
        hits_after.append((hit_ids(kv, query_a), hit_ids(kv, query_b)))
    assert taken == [4, 5, 2, 3, 1, 0]
    assert hits_after == [
        ([0, 1, 2], [0, 1, 3]),
        ([0, 1, 2], [0, 1, 3]),
        ([0, 1], [0, 1, 3]),
        ([0, 1], [0, 1]),
        ([0], [0]),
        ([], []),
    ]
    assert kv.pool.num_evictions == 4


def test_free_of_an_unknown_request_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=BLOCK_SIZE)
    prefill(kv, make_request("a", fresh_tokens(3)))
    before = snapshot(kv)
    kv.free(make_request("never-allocated", fresh_tokens(3)))
    assert snapshot(kv) == before
    kv.check_integrity()


def test_check_integrity_catches_a_block_the_tables_do_not_account_for():
    kv = KVCacheManager(num_blocks=2, block_size=BLOCK_SIZE)
    prefill(kv, make_request("a", fresh_tokens(3)))
    kv.pool.touch([kv.pool.blocks[0]])  # a reference no request holds
    with pytest.raises(AssertionError):
        kv.check_integrity()
