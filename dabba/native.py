"""dabba's native CPU kernels (dabba/csrc/*.cpp), built on first use and cached.

torch's C++ extension loader compiles them with g++ and ninja (about 30 s, once per machine and
source version) and registers them as ``torch.ops.dabba_cpu.*``. Where that is impossible (no
compiler, another platform), everything falls back to plain PyTorch, which stays the reference.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

logger = logging.getLogger("dabba")

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("paged_attention_cpu.cpp", "elementwise_cpu.cpp")


@functools.lru_cache(maxsize=None)
def load_cpu_ops() -> bool:
    try:
        from torch.utils.cpp_extension import load

        load(name="dabba_cpu", sources=[str(CSRC / s) for s in SOURCES], is_python_module=False,
             extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"], extra_ldflags=["-fopenmp"])
        return True
    except Exception as e:  # no compiler, no ninja, unsupported platform: the reference still works
        logger.warning("native CPU kernels unavailable (%s); using plain PyTorch", e)
        return False


def use_cpu_kernels(x: torch.Tensor) -> bool:
    """Whether ``x`` is a CPU tensor and the native kernels are here (layout checks are the caller's)."""
    return x.device.type == "cpu" and load_cpu_ops()


def native_rows(x: torch.Tensor) -> bool:
    """Whether a [rows, features] tensor can go to the native row kernels."""
    return x.dim() == 2 and x.is_contiguous() and use_cpu_kernels(x)
