"""Which layers share a block table: KV-cache groups by attention kind (vLLM v1's hybrid allocator).

A layer with a sliding window W never reads keys more than W - 1 positions behind its query, so
its blocks can be freed once the window has passed them; a full-attention layer keeps every
block. One block table per request cannot serve both, so layers are grouped by kind and each
group has its own table over one shared pool of blocks.

To share the pool, every group has the same number of layers (the smallest kind's count; the
last group of a kind may be short, its missing layers' memory unused). Block id b then means
"slot b of every layer in the group", and the cache is ``group_size`` tensors of num_blocks
blocks: layer j of each group lives in tensor j. One kind (Llama, Mistral) is one group of all
layers: one table, as before. Gemma-3-1B (22 sliding layers, 4 global): group size 4, one full
group and six sliding groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroup:
    layer_ids: tuple[int, ...]
    sliding_window: int | None  # keys a query sees (itself included); None: the whole context

    def blocks_needed(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """Most blocks a request with ``num_tokens`` cached tokens holds at once in this group,
        computing at most ``max_chunk`` tokens a step: all of them for full attention; with a
        window, the window behind the chunk's first query plus the chunk, across block edges."""
        full = cdiv(num_tokens, block_size)
        if self.sliding_window is None:
            return full
        return min(full, cdiv(self.sliding_window - 1 + max_chunk, block_size) + 1)

    def num_skipped_blocks(self, num_computed_tokens: int, block_size: int) -> int:
        """Leading blocks no query from position ``num_computed_tokens`` on can see: with window W
        the first query sees keys from num_computed - W + 1 on."""
        if self.sliding_window is None:
            return 0
        return max(0, (num_computed_tokens - self.sliding_window + 1) // block_size)


def group_layers(layer_windows: Sequence[int | None]) -> list[KVCacheGroup]:
    """Group layers (given each one's window) into equal-sized groups of one kind each, full
    attention first, each kind in layer order."""
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    kinds: dict[int | None, list[int]] = {}
    for i, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(i)
    size = min(len(layers) for layers in kinds.values())
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    return [KVCacheGroup(tuple(kinds[w][i:i + size]), w) for w in order for i in range(0, len(kinds[w]), size)]


def group_size(groups: Sequence[KVCacheGroup]) -> int:
    """Layers per block of the shared pool: the number of cache tensors."""
    return max(len(g.layer_ids) for g in groups)


def layer_slots(groups: Sequence[KVCacheGroup]) -> dict[int, tuple[int, int]]:
    """layer -> (its group, the cache tensor it lives in)."""
    return {layer: (g, j) for g, group in enumerate(groups) for j, layer in enumerate(group.layer_ids)}
