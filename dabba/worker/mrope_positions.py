"""Qwen2.5-VL's M-RoPE positions (transformers' get_rope_index): a text token's temporal, height
and width positions are all one number, which counts on from the previous token's; an image's
tokens take its frame, row and column (in merge groups) past the text before it, and the text
after the image counts on from there plus the image's larger side, not from its token count.
So a token's position runs behind its index by a delta that grows with each image; past the
prompt (the outputs) every token is at its index plus the prompt's final delta."""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from dabba.core.multimodal import MultiModalFeature
from dabba.worker.model_inputs import FlatBatch


class HasImagePositions(Protocol):
    mm_features: list[MultiModalFeature]
    num_prompt_tokens: int
    mrope: Any  # prompt_positions' result, once computed (None before)


def prompt_positions(num_tokens: int, images: list[MultiModalFeature], merge: int) -> tuple[np.ndarray, int]:
    """([3, num_tokens] positions of a prompt's tokens, the delta of those after it); each image's
    data has its patch ``grid`` (frames, rows, columns)."""
    positions = np.empty((3, num_tokens), dtype=np.int64)
    text_start = current = 0
    for image in sorted(images, key=lambda f: f.position.offset):
        offset, length = image.position.offset, image.position.length
        positions[:, text_start:offset] = current + np.arange(offset - text_start)
        current += offset - text_start
        frames, rows, columns = image.data.grid[0], image.data.grid[1] // merge, image.data.grid[2] // merge
        grid = np.stack(np.meshgrid(np.arange(frames), np.arange(rows), np.arange(columns), indexing="ij"))
        positions[:, offset:offset + length] = grid.reshape(3, -1) + current
        current += max(rows, columns)
        text_start = offset + length
    positions[:, text_start:] = current + np.arange(num_tokens - text_start)
    return positions, current - text_start  # the last text token's position + 1, less the prompt's length


def step_positions(states: list[HasImagePositions], batch: FlatBatch, merge: int) -> np.ndarray:
    """[3, num_tokens]: the M-RoPE positions of a flat batch's tokens."""
    positions = np.repeat(batch.positions[None], 3, axis=0)
    for i, state in enumerate(states):
        if not state.mm_features:
            continue  # text alone: every position its index
        if state.mrope is None:
            state.mrope = prompt_positions(state.num_prompt_tokens, state.mm_features, merge)
        table, delta = state.mrope
        rows = slice(int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1]))
        index = batch.positions[rows]
        positions[:, rows] = np.where(index < table.shape[1], table[:, np.minimum(index, table.shape[1] - 1)],
                                      index + delta)
    return positions
