"""The worker's half of the encoder cache (core/encoder_cache.py keeps the books): each image's
embeddings by content hash, encoded in the step the scheduler says, dropped when it says; and
where a step's image tokens sit in its flat batch, with the keys each of them sees.

    request i in the flat batch:  query_start_loc[i] ..  (positions num_computed[i] .. seq_lens[i] - 1)
    an image's placeholders:      offset .. offset + length - 1 (any part of it may fall in the step)
    its rows in the step:         embeddings[identifier][p - offset] at flat row query_start_loc[i] + p - num_computed[i]
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np
import torch

from dabba.core.multimodal import MultiModalFeature
from dabba.core.outputs import SchedulerOutput
from dabba.layers.embedding import EmbeddingRows


class HasImages(Protocol):
    mm_features: list[MultiModalFeature]
    num_computed_tokens: int


class ImageEmbeddings:
    """``encode``: the model's encoder (a list of images' inputs -> their embeddings, each
    [tokens, hidden]); ``bidirectional``: an image's tokens see the whole image (Gemma 3);
    ``mrope_merge``: an M-RoPE model's spatial merge size (its image tokens' positions are their
    places in the image, worker/mrope_positions.py), else 0."""

    def __init__(self, encode: Callable[[list[Any]], list[torch.Tensor]], bidirectional: bool,
                 mrope_merge: int = 0) -> None:
        self.encode = encode
        self.bidirectional = bidirectional
        self.mrope_merge = mrope_merge
        self.embeddings: dict[str, torch.Tensor] = {}

    def update(self, sched: SchedulerOutput, states: dict[str, HasImages]) -> None:
        """Drop what the scheduler evicted, then encode the step's images (each content once)."""
        for identifier in sched.free_encoder_hashes:
            self.embeddings.pop(identifier, None)
        todo: dict[str, Any] = {}
        for request_id, indices in sched.scheduled_encoder_inputs.items():
            for i in indices:
                feature = states[request_id].mm_features[i]
                todo.setdefault(feature.identifier, feature.data)
        if todo:
            for identifier, rows in zip(todo, self.encode(list(todo.values()))):
                self.embeddings[identifier] = rows

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
                rows.append(self.embeddings[feature.identifier][lo - pos.offset:hi - pos.offset])
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
