"""Image encoding in units, so that a step may run part of an image's encoding and the rest wait
for later steps (core/encoder_scheduling.py rations them while other requests decode): an encoder
written as a generator that yields after each unit of work (a chunk of patches through one phase
of a layer) and returns the image's embeddings. Run to the end in one go, it is the encoder's
forward: the same code either way."""
from __future__ import annotations

from typing import Generator, TypeVar

T = TypeVar("T")

CHUNK_ROWS = 512  # patches a unit takes through a layer's phase: a few tens of milliseconds of a tower's layer


def run_steps(steps: Generator[None, None, T]) -> T:
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
