"""Image encoding in units, so that a step may run part of an image's encoding and the rest wait
for later steps (core/image_budget.py rations them while other requests decode): an encoder
written as a generator that yields before each unit of work (a chunk of patches through one phase
of a layer) the unit's operations (flops: a multiply-add counts two), and returns the image's
embeddings. The worker prices a step's share in operations, so units of unequal size fill it
evenly; run to the end in one go, the generator is the encoder's forward: the same code either way."""
from __future__ import annotations

from typing import Any, Generator, TypeVar

T = TypeVar("T")

CHUNK_ROWS = 512  # patches a unit takes through a layer's phase: small enough that a step beside decodes takes a few


def run_steps(steps: Generator[Any, None, T]) -> T:
    """Every unit of ``steps``; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def row_chunks(num_rows: int, chunk_rows: int | None) -> list[slice]:
    """``num_rows`` rows in runs of ``chunk_rows`` (None: one run of all)."""
    size = num_rows if chunk_rows is None else chunk_rows
    return [slice(start, min(start + size, num_rows)) for start in range(0, num_rows, max(size, 1))]
