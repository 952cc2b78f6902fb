"""How many bytes the KV cache may take, on CPU or GPU."""
from __future__ import annotations

import os

import torch

CPU_KV_SHARE = 0.3  # of available RAM once the weights are loaded
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


def default_kv_cache_memory(device: torch.device, bytes_wanted: int) -> int:
    """A share of what is free now, capped at ``bytes_wanted`` (no point reserving more)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * GPU_KV_SHARE)
    else:
        budget = int(available_cpu_memory() * CPU_KV_SHARE)
    return min(budget, bytes_wanted)
