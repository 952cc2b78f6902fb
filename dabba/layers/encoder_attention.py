"""Attention as encoders need it: each request's tokens attend to all of its own, none of another's,
with no KV cache (an encoder's input runs in one step, whole, so its tokens start at position 0:
that is where one request ends and the next begins). And the token types of a text pair."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dabba.attention.backend import get_forward_context


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            scale: float, window: int | None = None) -> torch.Tensor:
    """q, k, v: [num_tokens, num_heads, head_dim] of whole requests -> [num_tokens, num_heads * head_dim].
    ``window``: a token sees only those at most this far from it, either way (ModernBERT's local layers)."""
    num_tokens, num_heads, head_dim = q.shape
    starts = (positions == 0).nonzero().flatten().tolist() + [num_tokens]
    out = torch.empty(num_heads, num_tokens, head_dim, dtype=q.dtype, device=q.device)
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))  # [num_heads, num_tokens, head_dim]
    for start, end in zip(starts, starts[1:]):
        mask = None
        if window is not None and end - start > window + 1:
            index = torch.arange(end - start, device=q.device)
            mask = (index[:, None] - index[None, :]).abs() <= window
        out[:, start:end] = F.scaled_dot_product_attention(qh[:, start:end], kh[:, start:end], vh[:, start:end],
                                                           attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(num_tokens, num_heads * head_dim)


def current_token_type_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """The step's token types ([num_tokens]: 1 in the second text of a pair, else 0)."""
    types = get_forward_context().token_type_ids
    return torch.zeros_like(input_ids) if types is None else types
