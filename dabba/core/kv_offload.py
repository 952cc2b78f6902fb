"""A tier under the KV pool: full prefix blocks the pool evicts are kept in host memory (the
worker holds their bytes, worker/kv_offload.py), so a later prompt that misses the pool loads
them back into fresh blocks instead of recomputing them.

The core decides everything and the worker only copies: this index is the one record of what the
tier holds (an LRU of block keys, bounded in blocks: --kv-offload-memory over the pool's bytes per
block), and each step's KVTransfers tell the worker what to copy before its forward:

    drops  keys the tier forgets (LRU, to make room)
    stores (pool block, key): a cached block the pool evicted this step, copied out before the
           step's forward writes the block again
    loads  (key, pool block): a tier hit copied into a fresh block, which the step then treats
           as computed (its tokens count as cached)

in that order. A key loaded this step is never dropped in it (pinned), and a key the tier already
holds is not stored again, only made most recently used.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable


@dataclass(frozen=True)
class TierHit:
    """A place in a request's prefix hit that the tier, not the pool, holds: allocate_slots gives
    it a fresh block and loads it."""
    key: Hashable


@dataclass
class KVTransfers:
    """The tier's part of a SchedulerOutput (see the module docstring for the order)."""
    drops: list[Hashable] = field(default_factory=list)
    stores: list[tuple[int, Hashable]] = field(default_factory=list)
    loads: list[tuple[Hashable, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.drops or self.stores or self.loads)


@dataclass
class TierStats:
    stored_blocks: int = 0  # copied into the tier
    loaded_blocks: int = 0  # copied back into the pool (tier hits)
    dropped_blocks: int = 0  # forgotten to make room
    missed_blocks: int = 0  # looked up past the pool's hit and not found (a prompt's first miss only)


class HostTierIndex:
    def __init__(self, capacity_blocks: int, bytes_per_block: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"the KV offload tier holds no block: {capacity_blocks} blocks")
        self.capacity, self.bytes_per_block = capacity_blocks, bytes_per_block
        self._keys: OrderedDict[Hashable, None] = OrderedDict()  # least recently used first
        self._pinned: set[Hashable] = set()
        self.pending = KVTransfers()
        self.stats = TierStats()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def bytes_held(self) -> int:
        return len(self._keys) * self.bytes_per_block

    def keys(self) -> list[Hashable]:
        """Least recently used first."""
        return list(self._keys)

    def evicted(self, block_id: int, key: Hashable) -> None:
        """The pool evicted cached block ``block_id`` (its content is complete): keep it."""
        if key in self._keys:
            self._keys.move_to_end(key)
            return
        while len(self._keys) >= self.capacity:
            victim = next((k for k in self._keys if k not in self._pinned), None)
            if victim is None:  # every key is being loaded this step: this block is not kept
                return
            del self._keys[victim]
            self.pending.drops.append(victim)
            self.stats.dropped_blocks += 1
        self._keys[key] = None
        self.pending.stores.append((block_id, key))
        self.stats.stored_blocks += 1

    def load(self, key: Hashable, block_id: int) -> None:
        """Copy ``key`` into fresh pool block ``block_id`` this step (it stays here too)."""
        self._keys.move_to_end(key)
        self._pinned.add(key)
        self.pending.loads.append((key, block_id))
        self.stats.loaded_blocks += 1

    def take(self) -> KVTransfers | None:
        """This step's transfers (None if none), for the SchedulerOutput."""
        transfers, self.pending = self.pending, KVTransfers()
        self._pinned.clear()
        return transfers or None

    def clear(self) -> None:
        """Forget every key (POST /cache/reset); the worker is told to drop them."""
        self.pending.drops.extend(k for k in self._keys if k not in self._pinned)
        for k in list(self._keys):
            if k not in self._pinned:
                del self._keys[k]
