"""The CPU backend: the reference backend's prefill, with decode attention in a native kernel.

Its cache layout differs in one way: keys are stored transposed within each block
([kv_heads, num_blocks, head_dim, block_size]), so the kernel's dot products of a query with a
block's keys run along contiguous memory (see csrc/paged_attention_cpu.cpp). The kernel is built
on first use with torch's C++ extension loader (g++ and ninja) and cached; if it cannot be
built, the engine falls back to the reference backend.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from dabba.attention.torch_ref import TorchRefBackend, TorchRefMetadata

logger = logging.getLogger("dabba")

CSRC = Path(__file__).resolve().parent.parent / "csrc"


@functools.lru_cache(maxsize=None)
def load_cpu_ops() -> bool:
    """Build (first time, ~20 s) or load the native CPU kernels; False if that is impossible here."""
    try:
        from torch.utils.cpp_extension import load

        load(name="dabba_cpu", sources=[str(CSRC / "paged_attention_cpu.cpp")], is_python_module=False,
             extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
        return True
    except Exception as e:  # no compiler, no ninja, unsupported platform: the reference still works
        logger.warning("native CPU attention kernel unavailable (%s); using the reference backend", e)
        return False


class CpuBackend(TorchRefBackend):
    def split_cache(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
        return kv_cache[0].view(num_kv_heads, num_blocks, head_dim, block_size), kv_cache[1]

    def write_kv(self, key_cache, value_cache, k, v, metadata: TorchRefMetadata) -> None:
        num_kv_heads, _, block_size, head_dim = value_cache.shape
        slots = metadata.slot_mapping
        key_cache.permute(0, 1, 3, 2)[:, slots // block_size, slots % block_size] = k.transpose(0, 1)
        value_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slots, v.transpose(0, 1))

    def gather_context(self, key_cache, value_cache, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return key_cache.index_select(1, block_ids).transpose(2, 3), value_cache.index_select(1, block_ids)

    def decode(self, q, key_cache, value_cache, metadata: TorchRefMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        torch.ops.dabba_cpu.paged_decode_attention(out, q.contiguous(), key_cache, value_cache,
                                                   metadata.decode_block_table, metadata.decode_seq_lens, scale)
        return out
