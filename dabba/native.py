"""dabba's native CPU kernels (dabba/csrc/*.cpp), built on first use and cached.

torch's C++ extension loader compiles them with g++ and ninja (about 30 s, once per machine and
source version) and registers them as ``torch.ops.dabba_cpu.*``. Where that is impossible (no
compiler, another platform), everything falls back to plain PyTorch, which stays the reference.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger("dabba")

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("paged_attention_cpu.cpp", "elementwise_cpu.cpp", "gemv_cpu.cpp", "gemm_cpu.cpp", "gemm_amx_cpu.cpp",
           "int8_gemv_cpu.cpp", "decode_cpu.cpp", "kernel_constants.cpp", "sampling_cpu.cpp",
           "int4_gemv_cpu.cpp")


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


@dataclass(frozen=True)
class KernelConstants:
    """The numbers the C++ kernels choose by, read from the build (csrc/cpu_ops.h defines them
    once): activation rows up to which a linear takes each kernel, and the native layer loop's
    linear kinds by name."""

    gemv_max_rows: int  # bf16: the GEMV up to here
    gemm_max_rows: int  # and the GEMM beyond, up to here; F.linear (oneDNN) past it
    int8_gemv_max_rows: int  # INT8 codes: the GEMV up to here
    int4_gemv_max_rows: int  # INT4 codes (PyTorch's packed layout): dabba's GEMV up to here, tinygemm beyond
    int8_gemm_min_rows: int  # INT8's GEMM from here to gemm_max_rows (bf16 activations)
    int8_dequant_min_rows: int  # past the GEMM (or float32 from here) INT8 dequantizes its codes
    amx_gemv_max_rows: int  # where the GEMM runs on AMX tiles (amx_usable): the GEMV only up to here
    amx_int8_gemm_min_rows: int  # and INT8's GEMM from here
    linear_kinds: dict[str, int]  # "dense", "int8", "int4" -> LinearKind in csrc/cpu_ops.h


@functools.lru_cache(maxsize=None)
def kernel_constants() -> KernelConstants | None:
    """None where the kernels could not be built (nothing then chooses by these numbers)."""
    if not load_cpu_ops():
        return None
    raw = dict(torch.ops.dabba_cpu.kernel_constants())
    kinds = {name.removeprefix("linear_kind."): raw.pop(name) for name in list(raw) if name.startswith("linear_kind.")}
    return KernelConstants(linear_kinds=kinds, **raw)


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


def amx_usable(in_features: int) -> bool:
    """Whether the GEMM runs on AMX tiles for this many input features here (csrc/gemm_amx_cpu.cpp):
    the CPU has AMX-BF16, the OS granted the tiles, and the features are a multiple of 32."""
    return gemm_available() and torch.ops.dabba_cpu.amx_usable(in_features)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with bf16 rows on the CPU through dabba's kernels: the GEMV for decode's few rows
    (it streams the weight at close to memory bandwidth, oneDNN at about half of it) and the GEMM
    beyond, up to gemm_max_rows (1.3-2x oneDNN's as PyTorch calls it; csrc/gemm_cpu.cpp). On AMX
    tiles, where the CPU has them, the GEMM takes every row count from one. Long prefills and
    other cases keep F.linear."""
    if x.dim() == 2 and x.device.type == "cpu" and weight.device.type == "cpu" and load_cpu_ops():
        return torch.ops.dabba_cpu.dense_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_act_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       activation: str) -> torch.Tensor | None:
    """act(gate) * up of the merged projection x [gate; up]^T on the CPU ("silu": SwiGLU,
    "gelu_tanh": GeGLU): where the GEMM runs, it applies the activation as it stores, so the
    projection is never written out. None off the CPU."""
    if x.dim() == 2 and x.device.type == "cpu" and weight.device.type == "cpu" and load_cpu_ops():
        op = {"silu": torch.ops.dabba_cpu.dense_linear_silu_and_mul,
              "gelu_tanh": torch.ops.dabba_cpu.dense_linear_gelu_tanh_and_mul}[activation]
        return op(x, weight, bias)
    return None


@functools.lru_cache(maxsize=None)
def int8_gemv_available() -> bool:
    return load_cpu_ops() and torch.ops.dabba_cpu.int8_gemv_available()


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x (codes * scales[:, None])^T + bias on the CPU through dabba's INT8 kernels: the INT8 GEMV for
    decode's few rows (csrc/int8_gemv_cpu.cpp), the GEMM on codes widened to bf16 from
    int8_gemm_min_rows to gemm_max_rows (csrc/gemm_cpu.cpp; KernelConstants), codes dequantized + linear for long
    prefills, else PyTorch's _weight_int8pack_mm. None off the CPU or without the native kernels."""
    if x.dim() == 2 and x.device.type == "cpu" and load_cpu_ops():
        return torch.ops.dabba_cpu.int8_linear(x, codes, scales, bias)
    return None
