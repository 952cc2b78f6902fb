"""Reference attention in plain PyTorch over the paged cache: gather blocks, then SDPA.

The oracle other backends must match. Runs on CPU and CUDA alike. Each prefill chunk gets its
own SDPA (causal over its fresh keys when it has no earlier context, masked otherwise: to each
query's own position, or to its key_end where the metadata has one; with a layer's sliding window
W, from the key p - W + 1 of each query position p on). A layer
with a soft cap (Gemma 2: scores -> cap * tanh(scores / cap), which SDPA cannot apply) gets the
same attention written out: softcapped_attention. Decodes
(one query token each) are batched: their blocks are gathered into one padded, masked batch and
attended with two batched matmuls and a float32 softmax (benchmarks/design_choices.py:
decode_attention times SDPA with the same mask beside them).

Cache layout per layer: [2 (k|v), num_kv_heads, num_blocks, block_size, head_dim]. Heads lead so
that gathering a request's blocks yields contiguous [num_kv_heads, batch, context, head_dim]
operands for the matmuls, without a transposing copy.

With an 8-bit cache (kv_quant.py) a layer's cache is a pair: the codes in that layout and their
scales [2, num_kv_heads, num_blocks, block_size]. Only the blocks a step reads are gathered and
dequantized, and this step's fresh keys and values are attended as they were stored (quantized
and restored), so a result does not depend on whether its context came from the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dabba.attention.backend import AttentionBackend, CommonAttentionMetadata
from dabba.attention.kv_quant import KVQuant


@dataclass
class PrefillChunk:
    start: int  # flat token range start .. end
    end: int
    context_len: int  # tokens of this request already in the cache before this step
    block_ids: torch.Tensor | None  # [num_blocks] when context_len > 0
    mask: torch.Tensor | None  # [query_len, seq_len] bool, True = may attend
    key_ends: torch.Tensor | None = None  # [query_len]: where each query's keys end, where not causal


@dataclass
class TorchRefMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]
    decode_token_idx: torch.Tensor | None  # [num_decodes]
    decode_block_table: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_mask: torch.Tensor | None  # [1, num_decodes, 1, max_blocks * block_size], True = padding
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int64
    prefills: list[PrefillChunk]


def window_mask(context_len: int, seq_len: int, sliding_window: int | None, device,
                key_ends: torch.Tensor | None = None) -> torch.Tensor:
    """[seq_len - context_len, seq_len] bool, True = may attend: the queries at positions
    context_len .. seq_len - 1, each seeing keys up to itself (or to ``key_ends`` - 1), from
    p - W + 1 on with a window W (transformers' sliding window AND (causal OR image block))."""
    positions = torch.arange(context_len, seq_len, device=device)[:, None]
    keys = torch.arange(seq_len, device=device)[None, :]
    mask = keys <= positions if key_ends is None else keys < key_ends[:, None]
    return mask if sliding_window is None else mask & (keys > positions - sliding_window)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                         softcap: float) -> torch.Tensor:
    """SDPA with the scores soft-capped, as transformers' eager attention orders it: (q . k) * scale,
    then cap * tanh(. / cap), then the mask, a float32 softmax, and the probabilities in q's dtype
    times v. q [..., heads, query_len, d], k/v [..., kv_heads, seq_len, d] -> like q; ``mask``
    [query_len, seq_len] is True where a query may attend; None means causal, the queries being the
    last query_len positions."""
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [..., heads, query_len, seq_len]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        query_len, seq_len = scores.shape[-2:]
        positions = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
        mask = torch.arange(seq_len, device=q.device)[None, :] <= positions
    scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), v)


class TorchRefBackend(AttentionBackend):
    def __init__(self, kv_quant: KVQuant | None = None) -> None:
        self.kv_quant = kv_quant

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_dim)

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchRefMetadata:
        device, bs = common.device, common.block_size
        query_lens = common.query_lens
        starts = common.query_start_loc[:-1]
        is_decode = query_lens == 1

        decode_token_idx = decode_block_table = decode_mask = decode_seq_lens = None
        if is_decode.any():
            rows = np.nonzero(is_decode)[0]
            seq_lens = common.seq_lens[rows]
            num_blocks = int(-(-seq_lens.max() // bs))
            decode_token_idx = torch.from_numpy(starts[rows]).to(device)
            decode_block_table = torch.from_numpy(np.ascontiguousarray(common.block_table[rows, :num_blocks])).to(device)
            padding = np.arange(num_blocks * bs)[None, :] >= seq_lens[:, None]
            decode_mask = torch.from_numpy(padding).to(device)[None, :, None, :]
            decode_seq_lens = torch.from_numpy(seq_lens).to(device)

        prefills = []
        for i in np.nonzero(~is_decode)[0]:
            start, q_len, seq_len = int(starts[i]), int(query_lens[i]), int(common.seq_lens[i])
            context_len = seq_len - q_len
            block_ids = mask = key_ends = None
            if common.key_ends is not None and (common.key_ends[start:start + q_len]
                                                != np.arange(context_len + 1, seq_len + 1)).any():
                key_ends = torch.from_numpy(common.key_ends[start:start + q_len].copy()).to(device)
            if context_len > 0:
                block_ids = torch.from_numpy(common.block_table[i, : -(-seq_len // bs)].copy()).to(device)
            if context_len > 0 or key_ends is not None:
                mask = window_mask(context_len, seq_len, None, device, key_ends)
            prefills.append(PrefillChunk(start, start + q_len, context_len, block_ids, mask, key_ends))
        return TorchRefMetadata(common.slot_mapping, decode_token_idx, decode_block_table, decode_mask, decode_seq_lens,
                                prefills)

    # ---- layout-specific pieces (a backend with another cache layout overrides these) ----
    def split_cache(self, kv_cache):
        if self.kv_quant is not None:  # (codes, scales) -> (key codes, key scales), (value codes, value scales)
            codes, scales = kv_cache
            return (codes[0], scales[0]), (codes[1], scales[1])
        return kv_cache[0], kv_cache[1]  # each [kv_heads, num_blocks, block_size, d]

    def write_kv(self, key_cache, value_cache, k, v, metadata: TorchRefMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k/v [num_tokens, kv_heads, d] at their slots; returns them as
        attention must see them (restored from 8 bits when the cache is quantized)."""
        slots = metadata.slot_mapping
        if self.kv_quant is None:
            for cache, x in ((key_cache, k), (value_cache, v)):
                cache.view(x.shape[1], -1, x.shape[2]).index_copy_(1, slots, x.transpose(0, 1))
            return k, v
        restored = []
        for (codes, scales), x in ((key_cache, k), (value_cache, v)):
            q, scale = self.kv_quant.quantize(x)
            codes.view(x.shape[1], -1, x.shape[2]).index_copy_(1, slots, q.transpose(0, 1))
            scales.view(x.shape[1], -1).index_copy_(1, slots, scale.T)
            restored.append(self.kv_quant.dequantize(q, scale))
        return restored[0], restored[1]

    def gather_context(self, key_cache, value_cache, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks in table order -> [kv_heads, len(block_ids), block_size, d] keys and values."""
        if self.kv_quant is None:
            return key_cache.index_select(1, block_ids), value_cache.index_select(1, block_ids)
        return tuple(self.kv_quant.dequantize(codes.index_select(1, block_ids), scales.index_select(1, block_ids))
                     for codes, scales in (key_cache, value_cache))

    def decode(self, q, key_cache, value_cache, metadata: TorchRefMetadata, scale: float,
               sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """Batched over decodes: [num_decodes, heads, d] -> [num_decodes, heads, d]. A decode at
        position p = seq_len - 1 with a window W sees keys p - W + 1 .. p: those before seq_len - W
        are masked like padding. ``softcap``: scores -> softcap * tanh(scores / softcap) before the mask."""
        num_decodes, num_blocks = metadata.decode_block_table.shape
        kd, vd = self.gather_context(key_cache, value_cache, metadata.decode_block_table.flatten())
        num_kv_heads, head_dim = kd.shape[0], kd.shape[-1]
        # [kv_heads, num_decodes, max_blocks * block_size, d]
        kd = kd.view(num_kv_heads, num_decodes, -1, head_dim)
        vd = vd.view(num_kv_heads, num_decodes, -1, head_dim)
        # [num_decodes, heads, d] -> [kv_heads, num_decodes, heads per kv head, d]
        qd = q.view(num_decodes, num_kv_heads, -1, head_dim).transpose(0, 1)
        scores = torch.matmul(qd, kd.transpose(-1, -2)).float().mul_(scale)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        mask = metadata.decode_mask  # [1, num_decodes, 1, max_blocks * block_size], True = masked
        if sliding_window is not None:
            key_positions = torch.arange(mask.shape[-1], device=mask.device)
            slid_out = key_positions[None, :] < (metadata.decode_seq_lens - sliding_window)[:, None]
            mask = mask | slid_out[None, :, None, :]
        scores.masked_fill_(mask, float("-inf"))
        od = torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), vd)
        return od.transpose(0, 1).reshape(q.shape)

    def prefill(self, q, k, v, mask: torch.Tensor | None, scale: float, softcap: float | None = None) -> torch.Tensor:
        """One request's chunk: q [heads, query_len, d], k/v [kv_heads, seq_len, d] -> like q.
        ``mask`` [query_len, seq_len] is True where a query may attend; None means plain causal."""
        if softcap is not None:
            return softcapped_attention(q, k, v, mask, scale, softcap)
        # SDPA's CPU kernels want 4-D operands.
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
                                             scale=scale, enable_gqa=True)
        return out[0]

    # ---- the step -------------------------------------------------------------------------
    def forward(self, q, k, v, kv_cache, metadata: TorchRefMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        key_cache, value_cache = self.split_cache(kv_cache)
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        # Write first: a request may read blocks another request fills in this same step.
        k, v = self.write_kv(key_cache, value_cache, k, v, metadata)
        if not metadata.prefills:  # decodes only: token i is request i's one query
            return self.decode(q, key_cache, value_cache, metadata, scale, sliding_window, softcap)
        out = torch.empty_like(q)

        if metadata.decode_token_idx is not None:
            idx = metadata.decode_token_idx
            out[idx] = self.decode(q[idx], key_cache, value_cache, metadata, scale, sliding_window, softcap)

        for p in metadata.prefills:
            qp = q[p.start:p.end].transpose(0, 1).contiguous()  # [heads, query_len, d]
            if p.context_len == 0:
                kp = k[p.start:p.end].transpose(0, 1).contiguous()  # [kv_heads, query_len, d]
                vp = v[p.start:p.end].transpose(0, 1).contiguous()
            else:
                seq_len = p.mask.shape[1]
                kp, vp = self.gather_context(key_cache, value_cache, p.block_ids)
                kp = kp.reshape(num_kv_heads, -1, head_dim)[:, :seq_len]
                vp = vp.reshape(num_kv_heads, -1, head_dim)[:, :seq_len]
            mask, seq_len = p.mask, p.context_len + p.end - p.start
            if sliding_window is not None and sliding_window < seq_len:
                mask = window_mask(p.context_len, seq_len, sliding_window, q.device, p.key_ends)
            out[p.start:p.end] = self.prefill(qp, kp, vp, mask, scale, softcap).transpose(0, 1)
        return out
