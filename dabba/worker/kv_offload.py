"""The bytes of the host tier under the KV pool (core/kv_offload.py decides what moves; this
copies): per key, each layer's slice of one pool block, copied out of the pool before a step
overwrites the block and back into a fresh block when a prompt hits it.

Every backend lays a layer's cache out as (2, kv heads, blocks, ...) (attention/*.kv_cache_shape),
an 8-bit cache as (codes, scales) of that layout: a block is the slice at BLOCK_DIM of each."""
from __future__ import annotations

from typing import Any, Hashable

import torch

from dabba.core.kv_offload import KVTransfers

BLOCK_DIM = 2


def _parts(kv_caches: list[Any]) -> list[torch.Tensor]:
    return [part for cache in kv_caches for part in (cache if isinstance(cache, (tuple, list)) else (cache,))]


class HostKVTier:
    def __init__(self) -> None:
        self.blocks: dict[Hashable, list[torch.Tensor]] = {}  # key -> one slice per layer and part

    def apply(self, transfers: KVTransfers, kv_caches: list[Any]) -> None:
        """Drops, then stores, then loads (the order the core planned them in)."""
        for key in transfers.drops:
            del self.blocks[key]
        parts = _parts(kv_caches)
        if transfers.stores:
            ids = torch.tensor([block_id for block_id, _ in transfers.stores], device=parts[0].device)
            gathered = [p.index_select(BLOCK_DIM, ids).movedim(BLOCK_DIM, 0) for p in parts]  # [n, 2, heads, ...]
            for i, (_, key) in enumerate(transfers.stores):
                self.blocks[key] = [g[i].clone() for g in gathered]
        if transfers.loads:
            ids = torch.tensor([block_id for _, block_id in transfers.loads], device=parts[0].device)
            stored = [self.blocks[key] for key, _ in transfers.loads]
            for j, part in enumerate(parts):
                part.index_copy_(BLOCK_DIM, ids, torch.stack([s[j] for s in stored], dim=BLOCK_DIM))

    @property
    def bytes_held(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.blocks.values() for t in ts)
