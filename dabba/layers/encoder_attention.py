"""Attention as encoders need it: each request's tokens attend to all of its own, none of another's,
with no KV cache (an encoder's input runs in one step, whole, so its tokens start at position 0:
that is where one request ends and the next begins). And the token types of a text pair."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dabba.attention.backend import get_forward_context
from dabba.ops import native

MAX_NATIVE_HEAD_DIM = 256  # csrc/dense_attention_cpu.cpp's


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Unmasked attention of q [batch, heads, queries, d] over k, v [batch, heads, keys, d]
    (SDPA's layout) -> [batch, queries, heads, d], contiguous (what an output projection reads).
    The native flash tiles for bf16 on CPUs with bf16 dot products; PyTorch's SDPA, the reference,
    everywhere else."""
    if (q.dtype == torch.bfloat16 and k.dtype == v.dtype == q.dtype and q.shape[-1] <= MAX_NATIVE_HEAD_DIM
            and native.use_cpu_kernels(q) and native.dense_attention_available()
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and k.shape[2] > 0):
        out = q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])
        torch.ops.dabba_cpu.dense_attention(out, q, k, v, scale)
        return out
    return F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2).contiguous()


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            scale: float, window: int | None = None) -> torch.Tensor:
    """q, k, v: [num_tokens, num_heads, head_dim] of whole requests -> [num_tokens, num_heads * head_dim].
    ``window``: a token sees only those at most this far from it, either way (ModernBERT's local layers)."""
    num_tokens, num_heads, head_dim = q.shape
    starts = (positions == 0).nonzero().flatten().tolist() + [num_tokens]
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, num_heads, num_tokens, head_dim]
    for start, end in zip(starts, starts[1:]):
        rows = slice(start, end)
        if window is not None and end - start > window + 1:
            index = torch.arange(end - start, device=q.device)
            mask = (index[:, None] - index[None, :]).abs() <= window
            out[rows] = F.scaled_dot_product_attention(qh[..., rows, :], kh[..., rows, :], vh[..., rows, :],
                                                       attn_mask=mask, scale=scale)[0].transpose(0, 1)
        else:
            out[rows] = dense_attention(qh[..., rows, :], kh[..., rows, :], vh[..., rows, :], scale)[0]
    return out.reshape(num_tokens, num_heads * head_dim)


def current_token_type_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """The step's token types ([num_tokens]: 1 in the second text of a pair, else 0)."""
    types = get_forward_context().token_type_ids
    return torch.zeros_like(input_ids) if types is None else types
