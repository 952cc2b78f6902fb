"""The CPU backend: a step's attention, prefill chunks and decodes alike, in native kernels that
read the paged cache in place (csrc/paged_attention_cpu.cpp).

Its cache layout is the reference backend's with one difference: keys are stored transposed
within each block ([kv_heads, num_blocks, head_dim, block_size]), so a query's dot products with
a block's keys run along contiguous memory. A prompt's tokens are attended in tiles of
consecutive tokens that share every key and value load; the reference gathers each request's
blocks into a copy and runs matmuls or SDPA on it, several times slower (benchmarks/kernels.py:
attention, reference_layer_us against layer_us). The kernels are built on first use (see dabba/ops/native.py);
if they cannot be built, the engine uses the reference backend.

An 8-bit cache (kv_quant.py) is per layer a pair, as on the reference backend: the codes in this
layout, keys transposed likewise, and their float32 scales [2, kv_heads, num_blocks, block_size].
The kernels quantize this step's keys and values as KVQuant.quantize does and attend the codes in
place (a key's scale applied to its score, a value's folded into its probability): nothing is
dequantized into a copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dabba.attention.backend import AttentionBackend, CommonAttentionMetadata
from dabba.attention.kv_quant import KVQuant


@dataclass
class CpuMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_table: torch.Tensor  # [num_reqs, max_blocks] int64
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64
    seq_lens: torch.Tensor  # [num_reqs] int64: context + this step's tokens
    decode_only: bool  # every request has one query token
    key_ends: torch.Tensor | None = None  # [num_tokens] int64: CommonAttentionMetadata's; None: causal


def split_blocks(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[2, kv_heads, num_blocks, block_size, head_dim] -> keys viewed [kv_heads, num_blocks,
    head_dim, block_size] (as stored: transposed per block) and values."""
    _, num_kv_heads, num_blocks, block_size, head_dim = cache.shape
    return cache[0].view(num_kv_heads, num_blocks, head_dim, block_size), cache[1]


class CpuBackend(AttentionBackend):
    """Full-precision and 8-bit caches (``kv_quant``). The native layer loop reads this backend's
    metadata and cache layout and calls the same attention kernels as forward() below."""

    def __init__(self, kv_quant: KVQuant | None = None) -> None:
        self.kv_quant = kv_quant

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_dim)

    def build_metadata(self, common: CommonAttentionMetadata) -> CpuMetadata:
        return CpuMetadata(common.slot_mapping, torch.from_numpy(np.ascontiguousarray(common.block_table, np.int64)),
                           torch.from_numpy(np.ascontiguousarray(common.query_start_loc, np.int64)),
                           torch.from_numpy(np.ascontiguousarray(common.seq_lens, np.int64)),
                           bool((common.query_lens == 1).all()),
                           None if common.key_ends is None else torch.from_numpy(np.ascontiguousarray(common.key_ends,
                                                                                                      np.int64)))

    def split_cache(self, kv_cache):
        """A layer's cache -> (key cache, value cache). 8-bit: each a pair (codes, scales), the codes
        in their own dtype (int8, float8_e4m3fn), as the kernels read them."""
        if self.kv_quant is None:
            return split_blocks(kv_cache)
        codes, scales = kv_cache
        key_codes, value_codes = split_blocks(codes.view(self.kv_quant.code_dtype))
        return (key_codes, scales[0]), (value_codes, scales[1])

    def write_kv(self, key_cache, value_cache, k, v, metadata: CpuMetadata) -> None:
        if self.kv_quant is None:
            torch.ops.dabba_cpu.write_kv_cache(key_cache, value_cache, k, v, metadata.slot_mapping)
            return
        (key_codes, key_scales), (value_codes, value_scales) = key_cache, value_cache
        torch.ops.dabba_cpu.write_kv_cache(key_codes, value_codes, k, v, metadata.slot_mapping, key_scales,
                                           value_scales, self.kv_quant.q_max)

    def gather_context(self, key_cache, value_cache, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks in table order -> [kv_heads, len(block_ids), block_size, d] keys and values (tests);
        restored from 8 bits as the reference backend restores them."""
        if self.kv_quant is None:
            return key_cache.index_select(1, block_ids).transpose(2, 3), value_cache.index_select(1, block_ids)
        (key_codes, key_scales), (value_codes, value_scales) = key_cache, value_cache
        keys = self.kv_quant.dequantize(key_codes.index_select(1, block_ids).transpose(2, 3),
                                        key_scales.index_select(1, block_ids))
        return keys, self.kv_quant.dequantize(value_codes.index_select(1, block_ids),
                                              value_scales.index_select(1, block_ids))

    def forward(self, q, k, v, kv_cache, metadata: CpuMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        key_cache, value_cache = self.split_cache(kv_cache)
        # Write first: a request attends to this step's own keys, read back from the cache.
        self.write_kv(key_cache, value_cache, k, v, metadata)
        key_scales = value_scales = None  # the kernels' reading of a full-precision cache
        if self.kv_quant is not None:
            (key_cache, key_scales), (value_cache, value_scales) = key_cache, value_cache
        out = torch.empty_like(q)
        if metadata.decode_only:  # (a query alone sees no key past itself: key_ends say nothing)
            torch.ops.dabba_cpu.paged_decode_attention(out, q.contiguous(), key_cache, value_cache,
                                                       metadata.block_table, metadata.seq_lens, scale,
                                                       sliding_window or 0, softcap or 0.0, key_scales, value_scales)
        else:
            torch.ops.dabba_cpu.paged_attention(out, q.contiguous(), key_cache, value_cache, metadata.block_table,
                                                metadata.query_start_loc, metadata.seq_lens, scale,
                                                sliding_window or 0, softcap or 0.0, key_scales, value_scales,
                                                key_ends=metadata.key_ends)
        return out
