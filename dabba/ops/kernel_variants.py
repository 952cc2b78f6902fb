"""The instruction-set variants the native kernels (dabba/csrc) are compiled for, and which one
the running CPU takes.

One source tree, compiled once per variant with that variant's flags: a build made for one CPU
and run on another that lacks its instructions dies with SIGILL, which nothing can catch, so
the choice is made here, from what the CPU reports, before any kernel is loaded. setup.py builds
every variant of the build machine's architecture into the wheel; an editable install builds the
chosen one on first use, into a cache named after it (dabba/ops/native.py). Plain data and no torch
import at module level: setup.py reads this file before torch's extension builder runs.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from typing import Mapping

ISA_ENV = "DABBA_CPU_ISA"  # a diagnostic override, as oneDNN's ONEDNN_MAX_CPU_ISA: never a feature switch

X86 = ("x86_64", "amd64")
# x86-64-v3 (Haswell, Zen 1 and later): AVX2, FMA, F16C, BMI1/2, LZCNT; as torch.cpu.get_capabilities() names them
_V3 = ("avx", "avx2", "fma3", "f16c", "bmi", "bmi2", "lzcnt")
# x86-64-v4 adds AVX-512 F/BW/CD/DQ/VL; dabba's AVX-512 kernels also need BF16 dot products and VNNI
_V4_BF16 = _V3 + ("avx512_f", "avx512_bw", "avx512_cd", "avx512_dq", "avx512_vl", "avx512_bf16", "avx512_vnni")


@dataclass(frozen=True)
class IsaVariant:
    """One compiled form of the kernels: its name (in the library's file name and DABBA_CPU_ISA),
    the compiler flags that select its instructions, the CPU features it needs to run, and the
    architectures it is built for."""

    name: str
    cflags: tuple[str, ...]
    needs: tuple[str, ...]
    machines: tuple[str, ...] | None  # platform.machine() values (lower case); None: any

    def builds_on(self, machine: str) -> bool:
        return self.machines is None or machine.lower() in self.machines

    def missing(self, caps: Mapping[str, object]) -> list[str]:
        return [feature for feature in self.needs if not caps.get(feature)]


# Best first: the CPU takes the first variant it can run. AMX is not among the needs: those kernels
# ask CPUID and the OS at run time (csrc/gemm_amx_cpu.cpp) and step aside where the tiles are absent.
VARIANTS = (
    IsaVariant("avx512", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16",
                          "-mamx-int8", "-mtune=sapphirerapids"), _V4_BF16, X86),
    IsaVariant("avx2", ("-march=x86-64-v3", "-mtune=haswell"), _V3, X86),
    IsaVariant("generic", (), (), None),  # the compiler's default target: x86-64 (SSE2), aarch64, ...
)
SOURCES = ("paged_attention_cpu.cpp", "paged_attention_amx_cpu.cpp", "kv_cache_write_cpu.cpp", "elementwise_cpu.cpp",
           "gemv_cpu.cpp", "gemm_cpu.cpp", "gemm_amx_cpu.cpp", "gemm_avx2_cpu.cpp", "int8_gemv_cpu.cpp",
           "int8_code_gemm_cpu.cpp", "decode_cpu.cpp", "kernel_constants.cpp", "sampling_cpu.cpp", "int4_linear_cpu.cpp",
           "moe_cpu.cpp", "shm_group_cpu.cpp", "gguf_linear_cpu.cpp", "gguf_gemm_cpu.cpp", "w8a8_cpu.cpp",
           "dense_attention_cpu.cpp", "lora_cpu.cpp")  # in dabba/csrc
COMMON_CFLAGS = ("-O3", "-fopenmp", "-fno-trapping-math")
COMMON_LDFLAGS = ("-fopenmp",)


def library_name(variant: IsaVariant) -> str:
    """The compiled library's name: the ISA is part of it, so caches of different variants never mix."""
    return f"dabba_cpu_{variant.name}"


def variants_for(machine: str | None = None) -> list[IsaVariant]:
    """The variants a build on ``machine`` (default: this one) compiles, best first."""
    machine = machine or platform.machine()
    return [v for v in VARIANTS if v.builds_on(machine)]


def select_variant(caps: Mapping[str, object], machine: str | None = None,
                   override: str | None = None) -> IsaVariant:
    """The best variant this CPU runs (``caps``: torch.cpu.get_capabilities()), or the one
    ``override`` names (DABBA_CPU_ISA), refused with a ValueError where the CPU cannot run it."""
    candidates = variants_for(machine)
    if override:
        by_name = {v.name: v for v in candidates}
        if override not in by_name:
            raise ValueError(f"{ISA_ENV}={override!r}: expected one of {', '.join(by_name)} on "
                             f"{machine or platform.machine()}")
        chosen = by_name[override]
        missing = chosen.missing(caps)
        if missing:
            raise ValueError(f"{ISA_ENV}={override}: this CPU lacks {', '.join(missing)}, which that variant needs")
        return chosen
    return next(v for v in candidates if not v.missing(caps))


def running_variant() -> IsaVariant:
    """The variant for this process: the CPU's best, or DABBA_CPU_ISA's."""
    import torch

    try:
        caps = torch.cpu.get_capabilities()  # cpuinfo's view of the CPU
    except (AttributeError, RuntimeError):  # a build without it: only the generic variant is safe
        caps = {}
    return select_variant(caps, override=os.environ.get(ISA_ENV) or None)
