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
import torch.nn.functional as F

logger = logging.getLogger("dabba")

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("paged_attention_cpu.cpp", "elementwise_cpu.cpp", "gemv_cpu.cpp", "gemm_cpu.cpp", "int8_gemv_cpu.cpp",
           "decode_cpu.cpp")
GEMV_MAX_ROWS = 8  # activation rows up to which a bf16 linear takes the native GEMV (csrc/cpu_ops.h)
GEMM_MAX_ROWS = 256  # and the native GEMM beyond, up to here; F.linear (oneDNN) past it
INT8_GEMV_MAX_ROWS = 6  # the same for INT8 codes
INT8_GEMM_MIN_ROWS = 13  # INT8's GEMM from here to GEMM_MAX_ROWS (bf16 activations)
INT8_DEQUANT_MIN_ROWS = 96  # past the GEMM (or float32 from here) INT8 dequantizes its codes for a linear


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


@functools.lru_cache(maxsize=None)
def gemv_available() -> bool:
    return load_cpu_ops() and torch.ops.dabba_cpu.gemv_available()


@functools.lru_cache(maxsize=None)
def gemm_available() -> bool:
    return load_cpu_ops() and torch.ops.dabba_cpu.gemm_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with bf16 rows on the CPU through dabba's kernels: the GEMV for decode's few rows
    (it streams the weight at close to memory bandwidth, oneDNN at about half of it) and the GEMM
    beyond, up to GEMM_MAX_ROWS (1.3-2x oneDNN's as PyTorch calls it; csrc/gemm_cpu.cpp). Long
    prefills and other cases keep F.linear."""
    if x.dim() == 2 and x.device.type == "cpu" and weight.device.type == "cpu" and load_cpu_ops():
        return torch.ops.dabba_cpu.dense_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """silu(gate) * up of the merged projection x [gate; up]^T on the CPU: where ``linear`` takes
    the GEMM, the GEMM applies it as it stores, so the projection is never written out. None off
    the CPU."""
    if x.dim() == 2 and x.device.type == "cpu" and weight.device.type == "cpu" and load_cpu_ops():
        return torch.ops.dabba_cpu.dense_linear_silu_and_mul(x, weight, bias)
    return None


@functools.lru_cache(maxsize=None)
def int8_gemv_available() -> bool:
    return load_cpu_ops() and torch.ops.dabba_cpu.int8_gemv_available()


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x (codes * scales[:, None])^T + bias on the CPU through dabba's INT8 kernels: the INT8 GEMV for
    decode's few rows (csrc/int8_gemv_cpu.cpp), the GEMM on codes widened to bf16 from
    INT8_GEMM_MIN_ROWS to GEMM_MAX_ROWS (csrc/gemm_cpu.cpp), codes dequantized + linear for long
    prefills, else PyTorch's _weight_int8pack_mm. None off the CPU or without the native kernels."""
    if x.dim() == 2 and x.device.type == "cpu" and load_cpu_ops():
        return torch.ops.dabba_cpu.int8_linear(x, codes, scales, bias)
    return None
