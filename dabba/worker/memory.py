"""How many bytes the KV cache may take, on CPU or GPU."""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Any, Sequence

import torch

from dabba.attention.kv_quant import SCALE_DTYPE
from dabba.core.kv_cache_groups import KVCacheGroup
from dabba.ops.host_memory import advise_huge_pages

CPU_KV_SHARE = 0.3  # of available RAM once the weights are loaded...
CPU_KV_MAX = 4 * 2**30  # ...but at most this: the cache is zeroed up front, so it is resident
GPU_KV_SHARE = 0.8  # of free GPU memory once the weights are loaded


def available_cpu_memory() -> int:
    """MemAvailable from /proc/meminfo (counts reclaimable cache), else free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_memory(device: torch.device) -> int:
    """What an allocation on ``device`` can take now."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_cpu_memory()


def check_fits(what: str, nbytes: int, device: torch.device, advice: str) -> None:
    """Refuse before allocating: on a CPU, an allocation past what is there ends with the OOM killer
    (no error, no message) or in swap, not with an exception."""
    available = available_memory(device)
    if nbytes > available:
        raise ValueError(f"{what}: {nbytes / 2**30:.2f} GiB needed, but only {available / 2**30:.2f} GiB of "
                         f"{'GPU ' if device.type == 'cuda' else ''}memory is available; {advice}")


def kv_bytes_for_sequences(groups: Sequence[KVCacheGroup], block_size: int, bytes_per_block: int, max_model_len: int,
                           max_num_seqs: int, max_chunk: int) -> int:
    """What ``max_num_seqs`` sequences of ``max_model_len`` tokens hold of the pool at once (with
    the pool's placeholder block where a group slides): more would never be used."""
    blocks_per_seq = sum(g.blocks_needed(max_model_len, block_size, max_chunk) for g in groups)
    null_block = any(g.sliding_window is not None for g in groups)
    return (max_num_seqs * blocks_per_seq + null_block) * bytes_per_block


def default_kv_cache_memory(device: torch.device, bytes_wanted: int) -> int:
    """A share of what is free now, capped at ``bytes_wanted`` (no point reserving more)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * GPU_KV_SHARE)
    else:
        budget = min(int(available_cpu_memory() * CPU_KV_SHARE), CPU_KV_MAX)
    return min(budget, bytes_wanted)


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_host_memory() -> None:
    """Let glibc's malloc reuse freed activation buffers instead of returning them to the OS.

    By default every buffer over 128 KiB-32 MiB is mmapped and unmapped per allocation, so a
    4096-token prefill step page-faults and zeroes ~100 MB of fresh pages for its activations;
    keeping them in the heap took 8% off a 16k-token prefill (the allocator vLLM's CPU build
    preloads, tcmalloc, does the same). Up to 256 MiB: a wide MLP's output at a few thousand rows
    (4096 x 8960 bf16 is 73 MB) page-faults on every call above 32 MiB, and glibc (2.36 here) takes
    thresholds past the 32 MiB its manual gives as the most. Best effort: a no-op off glibc.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 256 * 2**20)  # larger blocks (a big KV cache) stay mmapped
        libc.mallopt(_M_TRIM_THRESHOLD, 2**30)
        libc.mallopt(_M_TOP_PAD, 64 * 2**20)
    except (OSError, AttributeError):
        pass


def allocate_kv_cache(shape: tuple[int, ...], num_layers: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """One zeroed buffer for every layer's cache (huge pages on Linux CPUs), viewed per layer.

    Zeroed, not left empty: padded gathers read unused slots, and 0 * NaN garbage would be NaN.
    """
    buffer = torch.empty((num_layers, *shape), dtype=dtype, device=device)
    advise_huge_pages(buffer)
    buffer.zero_()
    return list(buffer.unbind(0))


def kv_cache_tensors(backend: Any, kv_quant: Any, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                     num_tensors: int, dtype: torch.dtype, device: torch.device) -> list[Any]:
    """``num_tensors`` caches of num_blocks blocks in the backend's layout: each a tensor, or
    (codes, scales) for an 8-bit cache."""
    shape = backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    if kv_quant is None:
        return allocate_kv_cache(shape, num_tensors, dtype, device)
    codes = allocate_kv_cache(shape, num_tensors, kv_quant.storage_dtype, device)
    scales = allocate_kv_cache(shape[:-1], num_tensors, SCALE_DTYPE, device)
    return list(zip(codes, scales))


def release_freed_host_memory() -> None:
    """Give the heap's free pages back to the OS (an unloaded model's weights): glibc keeps them
    otherwise, as keep_freed_host_memory asks of it. Best effort: a no-op off glibc."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
