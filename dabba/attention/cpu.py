"""The CPU backend: the reference backend's prefill, with decode attention in a native kernel.

Its cache layout differs in one way: keys are stored transposed within each block
([kv_heads, num_blocks, head_dim, block_size]), so the kernel's dot products of a query with a
block's keys run along contiguous memory (see csrc/paged_attention_cpu.cpp). Short prefill chunks
are attended with two batched matmuls, which beat SDPA's CPU kernel there. The kernel is built
on first use (see dabba/native.py); if it cannot be built, the engine uses the reference backend.
"""
from __future__ import annotations

import torch

from dabba.attention.torch_ref import TorchRefBackend, TorchRefMetadata

# Prefill chunks whose score matrix (heads x query_len x seq_len) is at most this many elements
# take the matmul path; larger ones go to SDPA, which never materialises the scores.
MATMUL_PREFILL_MAX_SCORES = 8 * 2**20


class CpuBackend(TorchRefBackend):
    """Full-precision caches only: an 8-bit cache runs on the reference backend (selector.py)."""

    def split_cache(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
        return kv_cache[0].view(num_kv_heads, num_blocks, head_dim, block_size), kv_cache[1]

    def native_decode_inputs(self, metadata: TorchRefMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if metadata.prefills or metadata.decode_block_table is None:
            return None
        return metadata.decode_block_table, metadata.decode_seq_lens, metadata.slot_mapping

    def write_kv(self, key_cache, value_cache, k, v, metadata: TorchRefMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        torch.ops.dabba_cpu.write_kv_cache(key_cache, value_cache, k, v, metadata.slot_mapping)
        return k, v

    def gather_context(self, key_cache, value_cache, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return key_cache.index_select(1, block_ids).transpose(2, 3), value_cache.index_select(1, block_ids)

    def decode(self, q, key_cache, value_cache, metadata: TorchRefMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        torch.ops.dabba_cpu.paged_decode_attention(out, q.contiguous(), key_cache, value_cache,
                                                   metadata.decode_block_table, metadata.decode_seq_lens, scale)
        return out

    def prefill(self, q, k, v, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        num_heads, query_len, head_dim = q.shape
        num_kv_heads, seq_len, _ = k.shape
        if num_heads * query_len * seq_len > MATMUL_PREFILL_MAX_SCORES:
            return super().prefill(q, k, v, mask, scale)
        if mask is None:
            mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=q.device).tril_()
        # [heads, L, d] -> [kv_heads, heads per kv head * L, d]: one matmul per kv head
        scores = torch.matmul(q.view(num_kv_heads, -1, head_dim), k.transpose(1, 2)).float().mul_(scale)
        scores = scores.view(num_kv_heads, -1, query_len, seq_len).masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(num_kv_heads, -1, seq_len)
        return torch.matmul(probs, v).view(num_heads, query_len, head_dim)
