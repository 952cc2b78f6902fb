"""The encoder cache's bookkeeping (the worker holds the embeddings): which images' embeddings are
kept, by content hash, within a bound of embedding rows; which requests still need each one.

An entry a request references stays until the request has computed past the image's tokens (or
finished, or was preempted). Unreferenced entries stay too, least recently used first out, so a
later request showing the same image (a follow-up turn, another sample of the prompt) finds its
embeddings without encoding it again. The hashes of evicted entries go to the worker with the
next step (``take_evicted``), before anything new is encoded into their room.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class _Entry:
    num_tokens: int
    request_ids: set[str] = field(default_factory=set)


class EncoderCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # embedding rows (one per image token)
        self.entries: dict[str, _Entry] = {}
        self.unreferenced: OrderedDict[str, int] = OrderedDict()  # evictable, least recently used first
        self.num_used = 0  # rows held by every entry, referenced or not
        self.under_way: set[str] = set()  # entries whose encodings have not ended
        self._evicted: list[str] = []

    def __contains__(self, identifier: str) -> bool:
        return identifier in self.entries

    @property
    def num_free(self) -> int:
        """Rows available for new entries, evicting unreferenced ones as needed."""
        return self.capacity - self.num_used + sum(self.unreferenced.values())

    def allocate(self, identifier: str, num_tokens: int, request_id: str, ready: bool = True) -> None:
        """Room for a new entry, referenced by ``request_id`` (the caller checked num_free);
        ``ready``: its embeddings are there by the time its tokens run this step."""
        assert identifier not in self.entries and num_tokens <= self.num_free, "checked by the caller"
        while self.capacity - self.num_used < num_tokens:
            evicted, rows = self.unreferenced.popitem(last=False)
            del self.entries[evicted]
            self.under_way.discard(evicted)
            self.num_used -= rows
            self._evicted.append(evicted)
        self.entries[identifier] = _Entry(num_tokens, {request_id})
        self.num_used += num_tokens
        if not ready:
            self.under_way.add(identifier)

    def is_ready(self, identifier: str) -> bool:
        return identifier not in self.under_way

    def mark_ready(self, identifiers: list[str] | None = None) -> None:
        """These entries' encodings ended (None: every entry's will have by the time the step's
        tokens run)."""
        if identifiers is None:
            self.under_way.clear()
        else:
            self.under_way.difference_update(identifiers)

    def add_ref(self, identifier: str, request_id: str) -> None:
        entry = self.entries[identifier]
        entry.request_ids.add(request_id)
        self.unreferenced.pop(identifier, None)

    def release(self, identifier: str, request_id: str) -> None:
        """``request_id`` no longer needs the entry; kept, evictable, once nothing does."""
        entry = self.entries.get(identifier)
        if entry is None or request_id not in entry.request_ids:
            return
        entry.request_ids.discard(request_id)
        if not entry.request_ids:
            self.unreferenced[identifier] = entry.num_tokens

    def take_evicted(self) -> list[str]:
        """Hashes evicted since the last call (the worker drops their embeddings)."""
        evicted, self._evicted = self._evicted, []
        return evicted
