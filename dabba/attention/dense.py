"""Attention over whole equal-length sequences with no KV cache: for calibration and evaluation
passes that run the model's layers directly on batches of fixed windows."""
from __future__ import annotations

import torch.nn.functional as F

from dabba.attention.backend import AttentionBackend
from dabba.attention.torch_ref import softcapped_attention, window_mask


class DenseCausalBackend(AttentionBackend):
    """Attention for calibration: equal-length sequences, causal, no KV cache."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len

    def kv_cache_shape(self, *args) -> tuple[int, ...]:
        return ()

    def build_metadata(self, common):
        return None

    def forward(self, q, k, v, kv_cache, metadata, scale, sliding_window=None, softcap=None):
        n = q.shape[0] // self.seq_len
        def split(t):  # [tokens, heads, d] -> [seqs, heads, L, d]
            return t.view(n, self.seq_len, *t.shape[1:]).transpose(1, 2)
        mask = None  # causal
        if sliding_window is not None and sliding_window < self.seq_len:
            mask = window_mask(0, self.seq_len, sliding_window, q.device)
        if softcap is not None:  # Gemma 2: SDPA cannot cap the scores
            out = softcapped_attention(split(q), split(k), split(v), mask, scale, softcap)
        else:
            out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask, is_causal=mask is None,
                                                 scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape)
