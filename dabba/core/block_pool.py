"""The pool of fixed-size KV blocks: reference counts, the free queue, and the prefix-cache map."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from typing import Callable, Hashable


# One character per block in block_states() (the dashboard's grid draws them)
BLOCK_FREE = "."  # holds nothing anyone can reuse
BLOCK_CACHED = "c"  # free, but holds a cached prefix a later prompt may hit
BLOCK_USED = "u"  # held by one request
BLOCK_SHARED = "s"  # held by several (a prefix they share)


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: Hashable | None = None  # set once the block is full and cached (its cache key)

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Owns every block.

    Invariants (``check_integrity``):
    - a block is in ``free_queue`` iff its ``ref_cnt`` is 0;
    - the free queue is in eviction order: head is evicted first (LRU);
    - ``cached[h]`` is the one block whose ``block_hash`` is h; a cached block with
      ref_cnt 0 stays reusable by a prefix hit until it is taken from the free queue head;
    - the null block (``with_null_block``: block 0) is never handed out, freed or cached: it
      stands in a block table for a block a sliding window has passed, which no kernel reads.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, with_null_block: bool = False) -> None:
        if num_blocks < 1 + with_null_block:
            raise ValueError(f"num_blocks must be >= {1 + with_null_block}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0] if with_null_block else None
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks if b is not self.null_block)
        self.cached: dict[Hashable, KVCacheBlock] = {}
        self.num_evictions = 0
        # told (block id, hash) each time a cached block's content is about to be overwritten (a tier keeps it)
        self.on_evict: Callable[[int, Hashable], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, or cached but used by nobody)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: Hashable) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free queue, evicting their cached contents."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block.block_id, block.block_hash)
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling unused ones out of the free queue."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: list[KVCacheBlock]) -> None:
        """Drop one reference each; blocks nobody uses join the queue tail in the order given."""
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_full_block(self, block: KVCacheBlock, block_hash: Hashable) -> None:
        """Publish a full block under its chained hash; the first block with a hash keeps it."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # an identical block is already cached; this one stays private
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()

    def block_states(self) -> str:
        """Every block but the null block, in id order, as BLOCK_FREE, BLOCK_CACHED, BLOCK_USED or
        BLOCK_SHARED."""
        return "".join(BLOCK_FREE if b.ref_cnt == 0 and b.block_hash is None else BLOCK_CACHED if b.ref_cnt == 0
                       else BLOCK_USED if b.ref_cnt == 1 else BLOCK_SHARED
                       for b in self.blocks if b is not self.null_block)

    def check_integrity(self) -> None:
        num_used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        num_null = self.null_block is not None
        assert num_used + len(self.free_queue) + num_null == self.num_blocks, (num_used, len(self.free_queue))
        for b in self.blocks:
            if b is self.null_block:
                assert b.ref_cnt == 0 and b.block_hash is None and b.block_id not in self.free_queue, b
                continue
            assert b.ref_cnt >= 0, b
            assert (b.ref_cnt == 0) == (b.block_id in self.free_queue), b
        for h, b in self.cached.items():
            assert b.block_hash == h, b
        assert sum(1 for b in self.blocks if b.block_hash is not None) == len(self.cached)
