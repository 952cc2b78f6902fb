"""A request's images as the scheduler sees them: where each one's tokens sit in the prompt, and a
hash of its content, which keys the encoder cache and the prefix cache's blocks. What the encoder
reads (pixel values) rides along for the worker, unread here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PlaceholderRange:
    """Prompt positions ``offset .. offset + length - 1``: the tokens an item's embeddings replace."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any of its tokens lie in ``start .. end - 1``."""
        return self.offset < end and start < self.end


@dataclass(frozen=True, eq=False)
class MultiModalFeature:
    """One image of a prompt. ``identifier`` hashes its content (equal images, equal identifiers,
    wherever they appear); ``data`` is its encoder input, for the worker."""

    identifier: str
    position: PlaceholderRange
    data: Any = None
