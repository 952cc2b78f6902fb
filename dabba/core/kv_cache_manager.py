"""Per-request block tables over the block pool, with prefix caching. Three verbs:
``get_computed_blocks`` (prefix hit), ``allocate_slots`` and ``free``."""
from __future__ import annotations

from dataclasses import dataclass

from dabba.core.block_pool import BlockPool, KVCacheBlock
from dabba.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Counted in tokens, once per (re)admission of a request."""

    num_queried_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already published
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, so the next prompts prefill in full (benchmarks' cold
        prompts). Refused (False) while requests hold blocks: their blocks stay as they are."""
        if self.req_to_blocks:
            return False
        self.pool.reset_prefix_cache()
        return True

    @property
    def usage(self) -> float:
        return self.pool.usage

    def filled_slots(self, num_computed_tokens: dict[str, int]) -> int:
        """Slots of in-use blocks that hold a computed token; a block shared by several requests
        (a cached prefix) is counted once, as it is stored once."""
        bs, filled = self.block_size, {}
        for request_id, blocks in self.req_to_blocks.items():
            n = num_computed_tokens.get(request_id, 0)
            for i, block in enumerate(blocks[: -(-n // bs)]):
                filled[block.block_id] = max(filled.get(block.block_id, 0), min(bs, n - i * bs))
        return sum(filled.values())

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks matching the request's prefix.

        At most ``num_tokens - 1`` tokens may come from the cache: the last token must be
        computed to give the logits of the next one.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt token's hidden state computed
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> list[KVCacheBlock] | None:
        """Give the request room for ``num_new_tokens`` more tokens, or None if blocks are short.

        ::

            | computed | prefix hit (new_computed_blocks) | new tokens  |
            0   num_computed_tokens                 num_computed   total
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_required = cdiv(total, self.block_size) - len(blocks) - len(new_computed_blocks)
        # Hit blocks nobody holds sit in the free queue: touching them removes them from it.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_required > self.pool.num_free_blocks - num_evictable_hits:
            return None

        if request.request_id not in self.req_to_blocks:
            self.prefix_stats.num_queried_tokens += request.num_tokens
            self.prefix_stats.num_hit_tokens += len(new_computed_blocks) * self.block_size
        self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_required, 0))
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        blocks.extend(new_computed_blocks)
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, blocks, min(total, request.num_tokens) // self.block_size)
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_full: int) -> None:
        """Publish blocks whose tokens are all known and computed by the end of this step.

        A block computed in the same step as another request reads it is safe: every layer
        writes the whole step's KV before any attention reads it.
        """
        if not self.enable_caching:
            return
        start = self.num_cached_blocks.get(request.request_id, 0)
        for i in range(start, num_full):
            self.pool.cache_full_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, num_full)

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first so shared prefixes are evicted last."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(list(reversed(blocks)))

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert b.ref_cnt == held.get(b.block_id, 0), (b, held.get(b.block_id, 0))
