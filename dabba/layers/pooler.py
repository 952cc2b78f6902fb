"""The pooling head: a request's final hidden states (after the model's last norm) -> one embedding,
computed chunk by chunk as chunked prefill hands them over, in float32."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dabba.arch.pooling_config import PoolerConfig
from dabba.pooling_params import PoolingParams


@dataclass
class PoolingState:
    """One request's pooling so far: MEAN's running sum, CLS's first row; LAST needs none."""

    total: torch.Tensor | None = None  # [hidden] float32
    num_tokens: int = 0


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.config = config

    def add(self, state: PoolingState, rows: torch.Tensor, first_position: int) -> None:
        """Take a chunk's rows ([num_tokens, hidden]), the first at ``first_position`` of the input."""
        kind = self.config.pooling_type
        if kind == "MEAN":
            chunk = rows.float().sum(dim=0)
            state.total = chunk if state.total is None else state.total + chunk
        elif kind == "CLS" and first_position == 0:
            state.total = rows[0].float()
        state.num_tokens += rows.shape[0]

    def pooled(self, state: PoolingState, last_row: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """The embedding once the whole input went through ([hidden], or [dimensions]): pooled,
        cut to ``dimensions`` (a Matryoshka prefix), then L2-normalised if asked (vLLM's order)."""
        kind = self.config.pooling_type
        if kind == "LAST":
            vector = last_row.float()
        elif kind == "MEAN":
            vector = state.total / state.num_tokens
        else:
            assert state.total is not None, "CLS pooling needs the input's first token computed"
            vector = state.total
        if params.dimensions is not None:
            vector = vector[:params.dimensions]
        normalize = self.config.normalize if params.normalize is None else params.normalize
        return F.normalize(vector, dim=-1) if normalize else vector
