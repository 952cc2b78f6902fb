"""The CPU backend: a step's attention, prefill chunks and decodes alike, in native kernels that
read the paged cache in place (csrc/paged_attention_cpu.cpp).

Its cache layout is the reference backend's with one difference: keys are stored transposed
within each block ([kv_heads, num_blocks, head_dim, block_size]), so a query's dot products with
a block's keys run along contiguous memory. A prompt's tokens are attended in tiles of
consecutive tokens that share every key and value load; the reference gathers each request's
blocks into a copy and runs matmuls or SDPA on it (at 256 prompt tokens, SmolLM's shape: 2.2 ms
per layer, against the kernel's 0.3). The kernels are built on first use (see dabba/native.py);
if they cannot be built, the engine uses the reference backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dabba.attention.backend import AttentionBackend, CommonAttentionMetadata


@dataclass
class CpuMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_table: torch.Tensor  # [num_reqs, max_blocks] int64
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64
    seq_lens: torch.Tensor  # [num_reqs] int64: context + this step's tokens
    decode_only: bool  # every request has one query token


class CpuBackend(AttentionBackend):
    """Full-precision caches only: an 8-bit cache runs on the reference backend (selector.py).
    The native layer loop reads this backend's metadata and cache layout and calls the same
    attention kernels as forward() below."""

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_dim)

    def build_metadata(self, common: CommonAttentionMetadata) -> CpuMetadata:
        return CpuMetadata(common.slot_mapping, torch.from_numpy(np.ascontiguousarray(common.block_table, np.int64)),
                           torch.from_numpy(np.ascontiguousarray(common.query_start_loc, np.int64)),
                           torch.from_numpy(np.ascontiguousarray(common.seq_lens, np.int64)),
                           bool((common.query_lens == 1).all()))

    def split_cache(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
        return kv_cache[0].view(num_kv_heads, num_blocks, head_dim, block_size), kv_cache[1]

    def write_kv(self, key_cache, value_cache, k, v, metadata: CpuMetadata) -> None:
        torch.ops.dabba_cpu.write_kv_cache(key_cache, value_cache, k, v, metadata.slot_mapping)

    def gather_context(self, key_cache, value_cache, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks in table order -> [kv_heads, len(block_ids), block_size, d] keys and values (tests)."""
        return key_cache.index_select(1, block_ids).transpose(2, 3), value_cache.index_select(1, block_ids)

    def forward(self, q, k, v, kv_cache, metadata: CpuMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        key_cache, value_cache = self.split_cache(kv_cache)
        # Write first: a request attends to this step's own keys, read back from the cache.
        self.write_kv(key_cache, value_cache, k, v, metadata)
        out = torch.empty_like(q)
        if metadata.decode_only:
            torch.ops.dabba_cpu.paged_decode_attention(out, q.contiguous(), key_cache, value_cache,
                                                       metadata.block_table, metadata.seq_lens, scale,
                                                       sliding_window or 0, softcap or 0.0)
        else:
            torch.ops.dabba_cpu.paged_attention(out, q.contiguous(), key_cache, value_cache, metadata.block_table,
                                                metadata.query_start_loc, metadata.seq_lens, scale,
                                                sliding_window or 0, softcap or 0.0)
        return out
