"""SwiGLU on a merged gate_up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dabba import native


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * intermediate] = gate | up  ->  silu(gate) * up."""
    if native.native_rows(x):
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
        torch.ops.dabba_cpu.silu_and_mul(out, x)
        return out
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
