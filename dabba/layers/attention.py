"""The attention layer: hands q/k/v to the step's backend with this layer's KV cache."""
from __future__ import annotations

import torch
from torch import nn

from dabba.attention.backend import get_forward_context


class Attention(nn.Module):
    """``sliding_window``: this layer's window in keys (a query at position p sees keys p - W + 1
    .. p), or None for the whole context; per layer, since families interleave both kinds.
    ``scale``: what q . k is multiplied by (default head_dim ** -0.5; Gemma: query_pre_attn_scalar
    ** -0.5). ``softcap``: scores -> softcap * tanh(scores / softcap) after the scale, before the
    mask and softmax (Gemma 2), or None."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 sliding_window: int | None = None, scale: float | None = None,
                 softcap: float | None = None) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, not {sliding_window}")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be > 0 or None, not {softcap}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.softcap = softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        ctx = get_forward_context()
        out = ctx.backend.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.layer_metadata(self.layer_idx),
                                  self.scale, self.sliding_window, self.softcap)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
