"""BlockPool: ref counts, the free queue in eviction (LRU) order, and the hash -> block map.

Hashes here are arbitrary bytes: the pool never looks inside them.
"""
from __future__ import annotations

import pytest

from dabba.core.block_pool import BlockPool

H0, H1, H2 = b"hash-0", b"hash-1", b"hash-2"


def free_queue_ids(pool: BlockPool) -> list[int]:
    """Block ids in eviction order: the head is taken (and evicted) first."""
    return list(pool.free_queue)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def ref_cnts(pool: BlockPool) -> list[int]:
    return [b.ref_cnt for b in pool.blocks]


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_pool_without_blocks_is_rejected(num_blocks):
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockPool(num_blocks)


def test_new_pool_is_all_free_in_id_order():
    pool = BlockPool(4)
    assert free_queue_ids(pool) == [0, 1, 2, 3]
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0
    assert ref_cnts(pool) == [0, 0, 0, 0]
    assert pool.cached == {}
    pool.check_integrity()


def test_new_blocks_come_from_the_queue_head_in_id_order():
    pool = BlockPool(4)
    first = pool.get_new_blocks(2)
    assert ids(first) == [0, 1]
    assert ids(pool.get_new_blocks(1)) == [2]
    assert ids(pool.get_new_blocks(0)) == []
    assert free_queue_ids(pool) == [3]
    assert ref_cnts(pool) == [1, 1, 1, 0]
    assert pool.num_free_blocks == 1
    assert pool.usage == 0.75
    assert pool.num_evictions == 0
    pool.check_integrity()


def test_over_allocation_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(RuntimeError, match="asked for 2 blocks, 1 free"):
        pool.get_new_blocks(2)
    assert free_queue_ids(pool) == [2]
    assert ref_cnts(pool) == [1, 1, 0]
    pool.check_integrity()
    with pytest.raises(RuntimeError):
        BlockPool(2).get_new_blocks(3)


def test_free_blocks_joins_the_tail_in_the_order_given():
    pool = BlockPool(4)
    b = pool.get_new_blocks(4)
    assert free_queue_ids(pool) == []
    pool.free_blocks([b[2], b[0]])
    assert free_queue_ids(pool) == [2, 0]
    pool.free_blocks([b[3], b[1]])
    assert free_queue_ids(pool) == [2, 0, 3, 1]
    assert ref_cnts(pool) == [0, 0, 0, 0]
    pool.check_integrity()
    # The queue order is the allocation order from now on.
    assert ids(pool.get_new_blocks(3)) == [2, 0, 3]
    assert free_queue_ids(pool) == [1]
    pool.check_integrity()


def test_a_block_joins_the_queue_only_when_its_last_reference_drops():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])  # a second holder, as with a shared prefix
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert free_queue_ids(pool) == [1, 2]
    pool.check_integrity()
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert free_queue_ids(pool) == [1, 2, 0]
    pool.check_integrity()


def test_double_free_is_an_internal_error():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([block])


def test_freed_cached_block_stays_reusable_until_taken_from_the_head():
    pool = BlockPool(4)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_full_block(b0, H0)
    pool.cache_full_block(b1, H1)
    pool.free_blocks([b0, b1])
    assert free_queue_ids(pool) == [2, 3, 0, 1]
    assert pool.get_cached_block(H0) is b0
    assert pool.get_cached_block(H1) is b1
    assert pool.num_free_blocks == 4  # cached but unused blocks count as free
    pool.check_integrity()

    # Uncached blocks at the head go first: nothing is evicted.
    assert ids(pool.get_new_blocks(2)) == [2, 3]
    assert pool.num_evictions == 0
    assert pool.get_cached_block(H0) is b0

    # Taking block 0 from the head evicts its hash, and only its hash.
    assert ids(pool.get_new_blocks(1)) == [0]
    assert pool.num_evictions == 1
    assert b0.block_hash is None
    assert pool.get_cached_block(H0) is None
    assert pool.get_cached_block(H1) is b1
    assert b0.ref_cnt == 1
    pool.check_integrity()

    assert ids(pool.get_new_blocks(1)) == [1]
    assert pool.num_evictions == 2
    assert pool.cached == {}
    pool.check_integrity()


def test_touch_pulls_unused_blocks_out_of_the_queue_and_takes_a_reference():
    pool = BlockPool(4)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_full_block(b0, H0)
    pool.free_blocks([b0])
    assert free_queue_ids(pool) == [2, 3, 0]

    hit = pool.get_cached_block(H0)
    pool.touch([hit, b1])
    assert hit is b0
    assert b0.ref_cnt == 1  # 0 -> 1: left the free queue
    assert b1.ref_cnt == 2  # 1 -> 2: was never in it
    assert free_queue_ids(pool) == [2, 3]
    assert pool.num_free_blocks == 2
    assert pool.num_evictions == 0
    assert b0.block_hash == H0  # a hit keeps the block cached
    pool.check_integrity()

    # A touched block is no longer evictable: new blocks skip it.
    assert ids(pool.get_new_blocks(2)) == [2, 3]
    assert pool.get_cached_block(H0) is b0
    pool.check_integrity()


def test_cache_full_block_keeps_the_first_block_for_a_hash():
    pool = BlockPool(3)
    b0, b1, b2 = pool.get_new_blocks(3)
    pool.cache_full_block(b0, H0)
    pool.cache_full_block(b1, H0)  # same contents computed again: stays private
    assert pool.get_cached_block(H0) is b0
    assert b1.block_hash is None
    pool.cache_full_block(b0, H2)  # a cached block never changes its hash
    assert b0.block_hash == H0
    assert pool.get_cached_block(H2) is None
    pool.cache_full_block(b2, H1)
    assert pool.cached == {H0: b0, H1: b2}
    pool.check_integrity()

    # The private duplicate is freed like any block and never answers a lookup.
    pool.free_blocks([b1, b0])
    assert free_queue_ids(pool) == [1, 0]
    assert ids(pool.get_new_blocks(1)) == [1]
    assert pool.num_evictions == 0
    assert pool.get_cached_block(H0) is b0
    pool.check_integrity()


def test_without_caching_nothing_is_published():
    pool = BlockPool(2, enable_caching=False)
    b0, _ = pool.get_new_blocks(2)
    pool.cache_full_block(b0, H0)
    assert b0.block_hash is None
    assert pool.get_cached_block(H0) is None
    assert pool.cached == {}
    pool.check_integrity()


def test_reset_prefix_cache_forgets_every_hash_but_keeps_references():
    pool = BlockPool(3)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_full_block(b0, H0)
    pool.cache_full_block(b1, H1)
    pool.free_blocks([b1])
    pool.reset_prefix_cache()
    assert pool.cached == {}
    assert (b0.block_hash, b1.block_hash) == (None, None)
    assert ref_cnts(pool) == [1, 0, 0]
    assert free_queue_ids(pool) == [2, 1]
    # Taking the formerly cached block is not an eviction any more.
    assert ids(pool.get_new_blocks(2)) == [2, 1]
    assert pool.num_evictions == 0
    pool.check_integrity()


def test_check_integrity_catches_a_used_block_in_the_free_queue():
    pool = BlockPool(2)
    pool.blocks[0].ref_cnt = 1  # corrupt: referenced, yet still queued
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_check_integrity_catches_a_stale_hash():
    pool = BlockPool(2)
    (b0,) = pool.get_new_blocks(1)
    pool.cache_full_block(b0, H0)
    b0.block_hash = H1  # corrupt: the map and the block disagree
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_block_states_draw_free_cached_used_and_shared_blocks():
    pool = BlockPool(6, with_null_block=True)  # block 0 is the null block: not drawn
    a, b, c = pool.get_new_blocks(3)  # blocks 1, 2, 3
    pool.cache_full_block(a, H0)
    pool.cache_full_block(c, H1)
    pool.touch([a])  # a second request shares block 1
    pool.free_blocks([c])  # block 3: free, its prefix still cached
    assert pool.block_states() == "suc.."
    pool.free_blocks([a, a, b])
    assert pool.block_states() == "c.c.."
