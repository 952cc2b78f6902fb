"""SwiGLU on a merged gate_up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, 2 * intermediate] = gate | up
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
