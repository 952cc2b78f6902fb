"""The worker's half of the encoder cache (core/encoder_cache.py keeps the books): each image's
embeddings by content hash, encoded in the steps the scheduler says (whole in one step, or a few
units a step while other requests decode), dropped when it says; and
where a step's image tokens sit in its flat batch, with the keys each of them sees.

    request i in the flat batch:  query_start_loc[i] ..  (positions num_computed[i] .. seq_lens[i] - 1)
    an image's placeholders:      offset .. offset + length - 1 (any part of it may fall in the step)
    its rows in the step:         embeddings[identifier][p - offset] at flat row query_start_loc[i] + p - num_computed[i]
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Protocol

import numpy as np
import torch

from dabba.core.multimodal import MultiModalFeature
from dabba.core.outputs import SchedulerOutput
from dabba.layers.embedding import EmbeddingRows
from dabba.models.encoder_steps import CHUNK_ROWS, run_steps


class HasImages(Protocol):
    mm_features: list[MultiModalFeature]
    num_computed_tokens: int


@dataclass
class EncoderWork:
    """What a step's encoding did (ModelRunnerOutput's encoded_images, encoder_units, encoder_work,
    encoder_seconds)."""

    encoded: list[str] = field(default_factory=list)
    units: int = 0
    operations: float = 0.0
    seconds: float = 0.0


class ImageEmbeddings:
    """``encode_steps``: the model's encoder in units (one image's input and a chunk size -> a
    generator yielding each unit's operations before it runs and returning the image's
    embeddings [tokens, hidden], models/encoder_steps.py); ``bidirectional``: an image's tokens
    see the whole image (Gemma 3); ``mrope_merge``: an M-RoPE model's spatial merge size (its image
    tokens' positions are their places in the image, worker/mrope_positions.py), else 0."""

    def __init__(self, encode_steps: Callable[[Any, int | None], Generator[float, None, torch.Tensor]],
                 bidirectional: bool, mrope_merge: int = 0) -> None:
        self.encode_steps = encode_steps
        self.bidirectional = bidirectional
        self.mrope_merge = mrope_merge
        self.embeddings: dict[str, torch.Tensor] = {}
        # encodings under way, oldest first: the generator, and its next unit's operations
        self.encodings: dict[str, tuple[Generator[float, None, torch.Tensor], float]] = {}

    def update(self, sched: SchedulerOutput) -> EncoderWork:
        """Drop what the scheduler evicted, start the step's new encodings (each content once),
        then run the units the step allows: all of every encoding under way (encoder_work None),
        or units while their operations fit ``encoder_work`` (one at least; 0: none), in chunks
        of CHUNK_ROWS patches."""
        for identifier in sched.free_encoder_hashes:
            self.embeddings.pop(identifier, None)
            self.encodings.pop(identifier, None)
        work = EncoderWork()
        start = time.perf_counter()
        budget = sched.encoder_work
        chunk_rows = None if budget is None else CHUNK_ROWS
        for features in sched.scheduled_encoder_inputs.values():
            for feature in features:
                if feature.identifier not in self.embeddings and feature.identifier not in self.encodings:
                    self._advance(feature.identifier, self.encode_steps(feature.data, chunk_rows), work)
        while self.encodings and budget != 0:
            identifier, (steps, cost) = next(iter(self.encodings.items()))
            if budget is not None and work.units and work.operations + cost > budget:
                break
            work.units += 1
            work.operations += cost
            self._advance(identifier, steps, work)
        work.seconds = time.perf_counter() - start
        return work

    def _advance(self, identifier: str, steps: Generator[float, None, torch.Tensor], work: EncoderWork) -> None:
        """Run ``steps`` to its next unit's start (its unit, or a new encoding's first setup)."""
        try:
            self.encodings[identifier] = (steps, next(steps))
        except StopIteration as done:
            self.embeddings[identifier] = done.value
            self.encodings.pop(identifier, None)
            work.encoded.append(identifier)

    def embeddings_of(self, identifier: str) -> torch.Tensor:
        """An image's embeddings; an encoding still under way (the scheduler learns of an end a
        step late, or ran out of steps to give it) runs to its end first."""
        if identifier in self.encodings:
            self.embeddings[identifier] = run_steps(self.encodings.pop(identifier)[0])
        return self.embeddings[identifier]

    def step_rows(self, states: list[HasImages], query_start_loc: np.ndarray, seq_lens: np.ndarray,
                  positions: np.ndarray, device: torch.device) -> tuple[EmbeddingRows | None, np.ndarray | None]:
        """The step's image rows, and (bidirectional) where each token's keys end, or None for
        each where the step holds no image token."""
        indices, rows, spans = [], [], []
        for i, state in enumerate(states):
            start, end = state.num_computed_tokens, int(seq_lens[i])
            for feature in state.mm_features:
                pos = feature.position
                if not pos.overlaps(start, end):
                    continue
                lo, hi = max(start, pos.offset), min(end, pos.end)
                assert not self.bidirectional or pos.end <= end, "the scheduler runs a bidirectional image whole"
                first_row = int(query_start_loc[i]) + lo - start
                indices.append(torch.arange(first_row, first_row + hi - lo))
                rows.append(self.embeddings_of(feature.identifier)[lo - pos.offset:hi - pos.offset])
                spans.append((first_row, first_row + hi - lo, pos.end))
        if not indices:
            return None, None
        image_rows = EmbeddingRows(torch.cat(indices).to(device), torch.cat(rows).to(device))
        if not self.bidirectional:
            return image_rows, None
        key_ends = positions + 1  # (the flat batch's positions: causal, but for the image tokens)
        for first_row, last_row, image_end in spans:
            key_ends[first_row:last_row] = image_end
        return image_rows, key_ends
