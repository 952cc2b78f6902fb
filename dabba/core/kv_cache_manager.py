"""Per-request block tables over the block pool, one per KV-cache group, with prefix caching.
Three verbs: ``get_computed_blocks`` (prefix hit), ``allocate_slots`` and ``free``.

Every group (kv_cache_groups.py) keeps its own table per request over the one shared pool. A
sliding-window group frees the blocks its window has passed and puts the pool's null block in
their place, so a long sequence holds only about a window's worth of blocks in such a group.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from dabba.core.block_pool import BlockPool, KVCacheBlock
from dabba.core.kv_cache_groups import KVCacheGroup, cdiv
from dabba.core.kv_offload import HostTierIndex, KVTransfers, TierHit
from dabba.core.request import Request

BlockTables = tuple[list[KVCacheBlock], ...]  # one table per group


@dataclass
class PrefixCacheStats:
    """Counted in tokens, once per (re)admission of a request."""

    num_queried_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 groups: Sequence[KVCacheGroup] | None = None, max_chunk: int | None = None,
                 tier: HostTierIndex | None = None) -> None:
        """``groups``: the model's KV-cache groups (default: one group, full attention);
        ``max_chunk``: the most tokens a request computes in one step (bounds what a sliding
        group holds; default: a whole sequence); ``tier``: host memory under the pool that keeps
        the prefix blocks it evicts (core/kv_offload.py; one full-attention group only)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups = tuple(groups) if groups else (KVCacheGroup((), None),)
        self.max_chunk = max_chunk
        self.sliding_groups = [g for g, group in enumerate(self.groups) if group.sliding_window is not None]
        self.pool = BlockPool(num_blocks, enable_caching, with_null_block=bool(self.sliding_groups))
        self.req_to_blocks: dict[str, BlockTables] = {}
        self.num_cached_blocks: dict[str, list[int]] = {}  # per group: leading blocks already published
        self.prefix_stats = PrefixCacheStats()
        self.tier = tier if enable_caching else None
        if self.tier is not None:
            if len(self.groups) > 1 or self.sliding_groups:
                raise ValueError("kv_offload_memory: a model with sliding-window layers cannot offload KV blocks yet")
            self.pool.on_evict = self.tier.evicted

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all but the null block."""
        return self.pool.num_blocks - (self.pool.null_block is not None)

    def blocks_needed(self, num_tokens: int) -> int:
        """Most blocks a request with ``num_tokens`` cached tokens holds at once, over all groups."""
        chunk = self.max_chunk or num_tokens
        return sum(g.blocks_needed(num_tokens, self.block_size, chunk) for g in self.groups)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, the tier's too, so the next prompts prefill in full
        (benchmarks' cold prompts). Refused (False) while requests hold blocks: their blocks stay
        as they are."""
        if self.req_to_blocks:
            return False
        self.pool.reset_prefix_cache()
        if self.tier is not None:
            self.tier.clear()
        return True

    def fetching(self, request: Request) -> bool:
        """Whether the request's prefix continues, past what the pool and the memory tier hold,
        in blocks on disk: they are fetched into memory off the engine thread (those not yet
        asked for), and the request waits for them rather than recompute them."""
        if self.tier is None or self.tier.disk is None or not request.uses_prefix_cache:
            return False
        hits, _ = self.get_computed_blocks(request)
        return self.tier.fetching([b.key for b in hits[0] if isinstance(b, TierHit)],
                                  [(0, h) for h in request.prefix_block_hashes[len(hits[0]):]])

    def fetched(self, read: list, failed: list) -> None:
        """The worker's report on disk reads (ModelRunnerOutput.kv_fetched / kv_fetch_failed)."""
        if self.tier is not None and (read or failed):
            self.tier.fetched(read, failed)
            for key in failed:  # recomputed already, before the failure came back: written again
                block = self.pool.cached.get(key)
                if block is not None:
                    self.tier.published(block.block_id, key)

    def offload_stats(self) -> dict[str, int]:
        """The tier's SchedulerStats fields (none without a tier)."""
        if self.tier is None:
            return {}
        stats, per_block, disk = self.tier.stats, self.tier.bytes_per_block, self.tier.disk
        out = {"kv_offload_memory_bytes": self.tier.bytes_held,
               "kv_offload_memory_stored_bytes": stats.stored_blocks * per_block,
               "kv_offload_memory_loaded_bytes": stats.loaded_blocks * per_block,
               "kv_offload_memory_hit_blocks": stats.loaded_blocks, "kv_offload_memory_missed_blocks": stats.missed_blocks}
        if disk is not None:
            out.update(kv_offload_disk_bytes=len(disk) * per_block,
                       kv_offload_disk_stored_bytes=disk.stats.stored_blocks * per_block,
                       kv_offload_disk_loaded_bytes=disk.stats.loaded_blocks * per_block,
                       kv_offload_disk_hit_blocks=disk.stats.loaded_blocks,
                       kv_offload_disk_failed_blocks=disk.stats.missed_blocks)
        return out

    def take_transfers(self) -> KVTransfers | None:
        """What the worker copies between the pool and the tier before this step's forward."""
        return self.tier.take() if self.tier is not None else None

    @property
    def usage(self) -> float:
        """Blocks held by requests / blocks they could hold (the null block counts in neither)."""
        return (self.num_usable_blocks - self.pool.num_free_blocks) / self.num_usable_blocks

    def filled_slots(self, num_computed_tokens: dict[str, int]) -> int:
        """Slots of in-use blocks that hold a computed token; a block shared by several requests
        (a cached prefix) is counted once, as it is stored once."""
        bs, filled = self.block_size, {}
        for request_id, tables in self.req_to_blocks.items():
            n = num_computed_tokens.get(request_id, 0)
            for blocks in tables:
                for i, block in enumerate(blocks[: -(-n // bs)]):
                    if block is not self.pool.null_block:
                        filled[block.block_id] = max(filled.get(block.block_id, 0), min(bs, n - i * bs))
        return sum(filled.values())

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's table in each group (the null block's id where a window has passed)."""
        tables = self.req_to_blocks.get(request_id)
        if tables is None:
            return tuple([] for _ in self.groups)
        return tuple([b.block_id for b in blocks] for blocks in tables)

    def get_computed_blocks(self, request: Request) -> tuple[BlockTables, int]:
        """Longest prefix of the request whose cached blocks serve every group: a full-attention
        group needs every block of it, a sliding group only those its window still sees from
        the first token to compute (the rest become the null block). Returns each group's hit
        blocks and the number of hit tokens.

        At most ``num_tokens - 1`` tokens may come from the cache: the last token must be
        computed to give the logits of the next one.
        """
        if not self.enable_caching or not request.uses_prefix_cache:
            return tuple([] for _ in self.groups), 0  # every prompt token's hidden state is needed
        hashes = request.prefix_block_hashes
        num_hit = len(hashes)
        while True:  # a group's hit is at most the others': shrink until all groups agree
            hits = tuple(self._longest_hit(g, hashes, num_hit) for g in range(len(self.groups)))
            shortest = min(len(h) for h in hits)
            if shortest == num_hit:
                break
            num_hit = shortest
        if self.tier is not None and num_hit < len(hashes):  # the tier may hold what follows
            extra = [TierHit((0, h)) for h in itertools.takewhile(lambda h: (0, h) in self.tier, hashes[num_hit:])]
            hits = (hits[0] + extra,)
            num_hit += len(extra)
        return hits, num_hit * self.block_size

    def cached_prefix_blocks(self, block_hashes: list) -> int:
        """How many leading blocks of a prompt (its chained hashes) the cache holds, as the
        first full-attention group sees them: a data-parallel router's estimate (PrefixCacheView).
        Only tests membership in one dict; nothing is reserved."""
        if not self.enable_caching:
            return 0
        g = next((i for i, group in enumerate(self.groups) if group.sliding_window is None), 0)
        cached = self.pool.cached
        for n, block_hash in enumerate(block_hashes):
            if (g, block_hash) not in cached:
                return n
        return len(block_hashes)

    def _longest_hit(self, g: int, hashes: list, max_blocks: int) -> list[KVCacheBlock]:
        """Group g's longest hit of at most ``max_blocks`` blocks (the null block where unneeded)."""
        group = self.groups[g]
        if group.sliding_window is None:
            hits = []
            for block_hash in hashes[:max_blocks]:
                block = self.pool.get_cached_block((g, block_hash))
                if block is None:
                    break
                hits.append(block)
            return hits
        # The largest k whose last cdiv(W - 1, block_size) blocks (all k, if fewer) are cached:
        # scan back from max_blocks, tracking the run of cached blocks that starts at i.
        need = cdiv(group.sliding_window - 1, self.block_size)
        if need == 0:
            return [self.pool.null_block] * max_blocks
        run: list[KVCacheBlock] = []
        for i in range(max_blocks - 1, -1, -1):
            block = self.pool.get_cached_block((g, hashes[i]))
            if block is None:
                run = []
                continue
            run.insert(0, block)
            if len(run) == need or i == 0:
                return [self.pool.null_block] * i + run
        return []

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: BlockTables | None = None,
        num_lookahead_tokens: int = 0,
    ) -> tuple[list[KVCacheBlock], ...] | None:
        """Give the request room for ``num_new_tokens`` more tokens in every group, and for
        ``num_lookahead_tokens`` after them in full-attention groups (a draft model's proposals write
        its KV there, through those tables), or None if blocks are short. Returns each group's new blocks.

        ::

            | computed | prefix hit (new_computed_blocks) | new tokens  | lookahead |
            0   num_computed_tokens                 num_computed   total
        """
        new_computed = new_computed_blocks or tuple([] for _ in self.groups)
        to_load = [hit for hit in new_computed[0] if isinstance(hit, TierHit)]  # the tier's part of the hit
        tables = self.req_to_blocks.get(request.request_id) or tuple([] for _ in self.groups)
        num_computed = request.num_computed_tokens + len(new_computed[0]) * self.block_size
        total = num_computed + num_new_tokens
        for g in self.sliding_groups:  # blocks the windows have passed go back to the pool first
            self._free_skipped(g, tables[g], num_computed)
        ends = [total + (num_lookahead_tokens if group.sliding_window is None else 0) for group in self.groups]
        num_required = [max(cdiv(end, self.block_size) - len(blocks) - len(hits), 0)
                        for end, blocks, hits in zip(ends, tables, new_computed)]
        # Hit blocks nobody holds sit in the free queue: touching them removes them from it.
        num_evictable_hits = sum(1 for hits in new_computed for b in hits
                                 if not isinstance(b, TierHit) and b.ref_cnt == 0 and b is not self.pool.null_block)
        if sum(num_required) + len(to_load) > self.pool.num_free_blocks - num_evictable_hits:
            return None

        if request.request_id not in self.req_to_blocks:
            self.prefix_stats.num_queried_tokens += request.num_tokens
            self.prefix_stats.num_hit_tokens += len(new_computed[0]) * self.block_size
            if self.tier is not None and request.uses_prefix_cache:
                self.tier.stats.missed_blocks += len(request.prefix_block_hashes) - len(new_computed[0])
            self.req_to_blocks[request.request_id] = tables
            self.num_cached_blocks[request.request_id] = [0] * len(self.groups)
        for hits in new_computed:  # every group's hits first: a new block must not be another group's hit
            self.pool.touch([b for b in hits if not isinstance(b, TierHit)])
        if to_load:  # fresh blocks for the tier's hits, loaded before the step's forward
            fresh = iter(self.pool.get_new_blocks(len(to_load)))
            loaded = [next(fresh) if isinstance(b, TierHit) else b for b in new_computed[0]]
            for hit, block in zip(new_computed[0], loaded):
                if isinstance(hit, TierHit):
                    self.tier.load(hit.key, block.block_id)
            new_computed = (loaded, *new_computed[1:])
        new_blocks = []
        for g, (blocks, hits, n) in enumerate(zip(tables, new_computed, num_required)):
            new = self.pool.get_new_blocks(n)
            blocks.extend(hits)
            blocks.extend(new)
            new_blocks.append(new)
            self._cache_full_blocks(request, g, blocks, min(total, request.num_tokens) // self.block_size)
        return tuple(new_blocks)

    def _free_skipped(self, g: int, blocks: list[KVCacheBlock], num_computed: int) -> None:
        """Swap the blocks group g's window has passed for the null block and free them."""
        skipped = min(self.groups[g].num_skipped_blocks(num_computed, self.block_size), len(blocks))
        freed = []
        for i in range(skipped - 1, -1, -1):  # newest first: scanning back stops at the first null
            if blocks[i] is self.pool.null_block:
                break
            freed.append(blocks[i])
            blocks[i] = self.pool.null_block
        self.pool.free_blocks(freed[::-1])  # oldest first: evicted first

    def _cache_full_blocks(self, request: Request, g: int, blocks: list[KVCacheBlock], num_full: int) -> None:
        """Publish blocks whose tokens are all known and computed by the end of this step, under
        (group, chained hash): groups hold different layers.

        A block computed in the same step as another request reads it is safe: every layer
        writes the whole step's KV before any attention reads it.
        """
        if not self.enable_caching:
            return
        done = self.num_cached_blocks[request.request_id]
        for i in range(done[g], num_full):
            if blocks[i] is not self.pool.null_block:
                self.pool.cache_full_block(blocks[i], (g, request.block_hashes[i]))
                if self.tier is not None and blocks[i].block_hash == (g, request.block_hashes[i]):
                    self.tier.published(blocks[i].block_id, blocks[i].block_hash)
        done[g] = max(done[g], num_full)

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first so shared prefixes are evicted last."""
        tables = self.req_to_blocks.pop(request.request_id, ())
        self.num_cached_blocks.pop(request.request_id, None)
        for blocks in tables:
            self.pool.free_blocks(list(reversed(blocks)))

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        for tables in self.req_to_blocks.values():
            assert len(tables) == len(self.groups)
            for blocks in tables:
                for b in blocks:
                    if b is not self.pool.null_block:
                        held[b.block_id] = held.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            if b is not self.pool.null_block:
                assert b.ref_cnt == held.get(b.block_id, 0), (b, held.get(b.block_id, 0))


class PrefixCacheView:
    """The one question another thread may ask of a KV cache while the engine thread steps it:
    how many leading blocks of a prompt it holds. Each lookup is one membership test in the pool's
    hash map, atomic under the GIL, so the answer is right as of some moment of the step, which a
    router's estimate allows; asking the engine thread instead would hold every routed request
    until a busy replica's step ends. A core in a process of its own would publish this map's
    changes to its router instead."""

    def __init__(self, manager: KVCacheManager) -> None:
        self._manager = manager

    def leading_blocks(self, block_hashes: list) -> int:
        return self._manager.cached_prefix_blocks(block_hashes)
