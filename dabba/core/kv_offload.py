"""Tiers under the KV pool: full prefix blocks the pool evicts are kept in host memory (the
worker holds their bytes, worker/kv_offload.py), and those the memory tier lets go on disk, so a
later prompt that misses the pool loads them back into fresh blocks instead of recomputing them.

The core decides everything and the worker only copies: this index is the one record of what the
tier holds (an LRU of block keys, bounded in blocks: --kv-offload-memory over the pool's bytes per
block), and each step's KVTransfers tell the worker what to copy before its forward:

    spills keys the memory tier lets go that the disk tier takes (written off the engine thread)
    drops  keys the memory tier forgets
    stores (pool block, key): a cached block the pool evicted this step, copied out before the
           step's forward writes the block again
    writes keys just stored that the disk tier takes as well (written off the engine thread), so
           that what memory holds outlives the process
    persists (pool block, key): a block this step computes, written to disk from the pool after
           the step's forward (the disk tier takes every full prefix block once: a restart finds them)
    loads  (key, pool block): a memory-tier hit copied into a fresh block, which the step then
           treats as computed (its tokens count as cached)
    fetches keys read from disk into memory (off the engine thread; the worker reports each one
           back, read or failed, in a later step's ModelRunnerOutput), and deletes: files the disk
           tier lets go

in that order, persists after the forward. A key loaded this step is never dropped in it (pinned), and a key the tier already
holds is not stored again, only made most recently used. A prompt whose next blocks sit on disk
waits (fetching()) while others' steps run; a block that fails its read is recomputed.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable


FETCH_HOLD_STEPS = 256  # steps a block fetched for a waiting prompt is kept from the LRU's victims


@dataclass(frozen=True)
class TierHit:
    """A place in a request's prefix hit that the tier, not the pool, holds: allocate_slots gives
    it a fresh block and loads it."""
    key: Hashable


@dataclass
class KVTransfers:
    """The tiers' part of a SchedulerOutput (see the module docstring for the order)."""
    spills: list[Hashable] = field(default_factory=list)
    drops: list[Hashable] = field(default_factory=list)
    stores: list[tuple[int, Hashable]] = field(default_factory=list)
    writes: list[Hashable] = field(default_factory=list)
    persists: list[tuple[int, Hashable]] = field(default_factory=list)
    loads: list[tuple[Hashable, int]] = field(default_factory=list)
    fetches: list[Hashable] = field(default_factory=list)
    deletes: list[Hashable] = field(default_factory=list)

    def __bool__(self) -> bool:
        return any((self.spills, self.drops, self.stores, self.writes, self.persists, self.loads, self.fetches,
                    self.deletes))


@dataclass
class TierStats:
    stored_blocks: int = 0  # copied into the tier
    loaded_blocks: int = 0  # copied back into the pool (tier hits)
    dropped_blocks: int = 0  # forgotten to make room
    missed_blocks: int = 0  # looked up past the pool's hit and not found (a prompt's first miss only)


class DiskTierIndex:
    """The keys the disk tier holds, least recently used first, bounded in files; filled at start
    from what an earlier run of the same model left (the worker checks each file when read)."""

    def __init__(self, capacity_files: int, keys: list[Hashable]) -> None:
        if capacity_files < 1:
            raise ValueError(f"the KV offload disk tier holds no block: {capacity_files} files")
        self.capacity = capacity_files
        self._keys: OrderedDict[Hashable, None] = OrderedDict((k, None) for k in keys[-capacity_files:])
        self.evicted_at_start = keys[:-capacity_files] if len(keys) > capacity_files else []
        self.fetching: set[Hashable] = set()
        self.stats = TierStats()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> list[Hashable]:
        return list(self._keys)

    def add(self, key: Hashable) -> list[Hashable]:
        """Take ``key`` (most recently used); the keys it pushes out (their files to delete)."""
        self._keys[key] = None
        self._keys.move_to_end(key)
        out = []
        while len(self._keys) > self.capacity:
            victim = next(k for k in self._keys if k not in self.fetching)
            del self._keys[victim]
            out.append(victim)
        self.stats.stored_blocks += 1
        self.stats.dropped_blocks += len(out)
        return out

    def touch(self, key: Hashable) -> None:
        self._keys.move_to_end(key)

    def discard(self, key: Hashable) -> None:
        self._keys.pop(key, None)
        self.fetching.discard(key)


class HostTierIndex:
    def __init__(self, capacity_blocks: int, bytes_per_block: int, disk: DiskTierIndex | None = None) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"the KV offload tier holds no block: {capacity_blocks} blocks")
        self.capacity, self.bytes_per_block = capacity_blocks, bytes_per_block
        self._keys: OrderedDict[Hashable, None] = OrderedDict()  # least recently used first
        self._pinned: set[Hashable] = set()
        # fetched from disk for a waiting prompt, kept until loaded into the pool (steps waited so far)
        self._fetched: dict[Hashable, int] = {}
        self.disk = disk
        self.pending = KVTransfers(deletes=list(disk.evicted_at_start) if disk else [])
        self._published: list[tuple[int, Hashable]] = []  # blocks this step computes: to disk after its forward
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
        if not self._make_room():  # every key is being loaded this step: this block is not kept
            return
        self._keys[key] = None
        self.pending.stores.append((block_id, key))
        self.stats.stored_blocks += 1
        if self.disk is not None:
            if key in self.disk:
                self.disk.touch(key)
            else:
                self.pending.writes.append(key)
                self.pending.deletes.extend(self.disk.add(key))

    def _make_room(self) -> bool:
        """Let the least recently used keys go (to disk, where there is one) until one more fits."""
        while len(self._keys) >= self.capacity:
            victim = next((k for k in self._keys if k not in self._pinned and k not in self._fetched), None)
            if victim is None:
                return False
            del self._keys[victim]
            self.stats.dropped_blocks += 1
            if self.disk is not None and victim not in self.disk:
                self.pending.spills.append(victim)
                self.pending.deletes.extend(self.disk.add(victim))
            else:
                self.pending.drops.append(victim)
        return True

    def fetching(self, held: list[Hashable], keys: list[Hashable]) -> bool:
        """Whether the leading ``keys`` (a prompt's blocks past its pool and memory hits ``held``)
        start with blocks on disk: then they are fetched (those not yet asked for), as many as
        memory can keep beside what it keeps for waiting prompts, and the prompt waits, its memory
        hits kept too (the blocks arriving must not push them out)."""
        if self.disk is None:
            return False
        run = list(itertools.takewhile(lambda k: k in self.disk and k not in self._keys, keys))
        if not run:
            return False
        for key in held:
            self._fetched[key] = 0
        if any(k in self.disk.fetching for k in run):
            return True  # on their way
        run = run[:max(self.capacity - len(self._fetched), 0)]  # what memory can keep until the prompt runs
        for key in run:
            self.disk.fetching.add(key)
            self.disk.touch(key)
            self.pending.fetches.append(key)
        return bool(run)

    def fetched(self, read: list[Hashable], failed: list[Hashable]) -> None:
        """The worker's report: ``read`` keys now sit in its memory tier; ``failed`` ones had no
        good file (deleted): their blocks will be recomputed."""
        for key in failed:
            self.disk.discard(key)
            self.disk.stats.missed_blocks += 1
        for key in read:
            self.disk.fetching.discard(key)
            self.disk.stats.loaded_blocks += 1
            if key in self._keys:  # stored again from the pool meanwhile: the same bytes
                continue
            if not self._make_room():
                self.pending.drops.append(key)  # no room now: the disk keeps it
                continue
            self._keys[key] = None
            self._fetched[key] = 0

    def published(self, block_id: int, key: Hashable) -> None:
        """The pool cached ``key`` in ``block_id``, computed by the end of this step (or before):
        the disk tier takes it after the step's forward."""
        if self.disk is not None:
            self._published.append((block_id, key))

    def load(self, key: Hashable, block_id: int) -> None:
        """Copy ``key`` into fresh pool block ``block_id`` this step (it stays here too)."""
        self._fetched.pop(key, None)
        self._keys.move_to_end(key)
        self._pinned.add(key)
        self.pending.loads.append((key, block_id))
        self.stats.loaded_blocks += 1

    def take(self) -> KVTransfers | None:
        """This step's transfers (None if none), for the SchedulerOutput."""
        for block_id, key in self._published:  # to disk once this step has computed them
            if key not in self.disk:
                self.pending.persists.append((block_id, key))
                self.pending.deletes.extend(self.disk.add(key))
        self._published = []
        transfers, self.pending = self.pending, KVTransfers()
        self._pinned.clear()
        for key in list(self._fetched):  # a prompt aborted while it waited: its blocks go back to the LRU
            self._fetched[key] += 1
            if self._fetched[key] > FETCH_HOLD_STEPS:
                del self._fetched[key]
        return transfers or None

    def clear(self) -> None:
        """Forget every key, on disk too (POST /cache/reset); the worker is told to drop them."""
        self.pending.drops.extend(k for k in self._keys if k not in self._pinned)
        for k in list(self._keys):
            if k not in self._pinned:
                del self._keys[k]
        if self.disk is not None:
            for k in self.disk.keys():
                if k not in self.disk.fetching:
                    self.disk.discard(k)
                    self.pending.deletes.append(k)
