"""dabba's native CPU kernels (dabba/csrc/*.cpp), as ``torch.ops.dabba_cpu.*``.

They come in instruction-set variants (dabba/ops/kernel_variants.py), and the running CPU's is loaded:
from the installed package where setup.py built it (a wheel needs no compiler), else compiled on
first use by torch's C++ extension loader (g++ and ninja, once per machine, variant and source
version; an editable install works this way). Where neither is possible (no compiler,
another platform), everything falls back to plain PyTorch, which stays the reference.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dabba.ops import kernel_variants

logger = logging.getLogger("dabba")

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # dabba/
CSRC = PACKAGE_DIR / "csrc"
PREBUILT = PACKAGE_DIR / "_kernels"  # setup.py's libraries, one per variant
PRECOMPILED_HEADERS = ("ATen/ATen.h", "ATen/Parallel.h", "torch/library.h")  # what most sources include


@functools.lru_cache(maxsize=None)
def load_cpu_ops() -> bool:
    """Load the variant for this CPU once per process; False where the kernels cannot be had. A
    DABBA_CPU_ISA that names no variant, or one this CPU cannot run, is a ValueError."""
    variant = kernel_variants.running_variant()
    try:
        source = _load_prebuilt(variant) or _build(variant)
    except Exception as e:  # no compiler, no ninja, unsupported platform: the reference still works
        logger.warning("native CPU kernels unavailable (%s); using plain PyTorch", e)
        return False
    logger.info("native CPU kernels: %s variant (%s)", variant.name, source)
    return True


def loaded_variant() -> str | None:
    """The name of the kernels' variant in this process, None where they are unavailable."""
    return kernel_variants.running_variant().name if load_cpu_ops() else None


def _load_prebuilt(variant: kernel_variants.IsaVariant) -> str | None:
    """The installed package's library of this variant, loaded; None where there is none."""
    libraries = sorted(PREBUILT.glob(f"{kernel_variants.library_name(variant)}.*so"))
    if not libraries:
        return None
    torch.ops.load_library(str(libraries[0]))
    return f"installed {libraries[0].name}"


def _build(variant: kernel_variants.IsaVariant) -> str:
    """Compile (or take from torch's extension cache) and load this variant. Builders take a
    file lock first, which the OS drops when a process dies; so whoever holds it knows that a
    torch build lock left in the directory is a killed build's, which would otherwise make every
    later load wait forever."""
    from torch.utils.cpp_extension import _get_build_directory, load

    name = kernel_variants.library_name(variant)
    build_dir = Path(_get_build_directory(name, verbose=False))  # torch's own choice (TORCH_EXTENSIONS_DIR)
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "dabba.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a build that was killed", stale)
            stale.unlink()
        cflags = [*kernel_variants.COMMON_CFLAGS, *variant.cflags]
        with _precompiled_header(build_dir, name, cflags) as include:
            load(name=name, sources=[str(CSRC / s) for s in kernel_variants.SOURCES], is_python_module=False,
                 build_directory=str(build_dir), extra_cflags=[*cflags, *include],
                 extra_ldflags=list(kernel_variants.COMMON_LDFLAGS))
    return f"built in {build_dir}"


@contextlib.contextmanager
def _precompiled_header(build_dir: Path, name: str, cflags: list[str]) -> Iterator[list[str]]:
    """Every source includes ATen, whose parsing is most of each file's compile time. Where the
    library looks out of date, GCC parses ATen once into a precompiled header, under the flags
    torch's loader gives the sources, and each source starts from it; the header (hundreds of MB)
    is deleted after the build. The sources are always told to include the header's text, so
    the compile commands, which the loader rebuilds on, never change; GCC reads the text where
    the precompiled form is absent, stale or foreign, which costs time, never correctness."""
    import subprocess
    import sysconfig

    from torch.utils import cpp_extension

    header = build_dir / "dabba_pch.h"
    text = "".join(f"#include <{h}>\n" for h in PRECOMPILED_HEADERS)
    if not header.exists() or header.read_text() != text:
        header.write_text(text)
    library = build_dir / f"{name}.so"
    newest_source = max(p.stat().st_mtime for p in CSRC.iterdir())
    compiler = cpp_extension.get_cxx_compiler()
    precompiled = Path(f"{header}.gch")
    if ((not library.exists() or library.stat().st_mtime < newest_source)
            and cpp_extension.check_compiler_is_gcc(compiler)):
        includes = [*cpp_extension.include_paths("cpu"), sysconfig.get_path("include", scheme="posix_prefix")]
        # torch's own flags for an extension's sources (_write_ninja_file_to_build_library), then ours
        command = [compiler, "-x", "c++-header", str(header), "-o", str(precompiled),
                   f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
                   *(f"-isystem{p}" for p in includes), "-fPIC", "-std=c++20", *cflags]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            logger.warning("precompiling ATen's headers failed; the build parses them per source: %s",
                           done.stderr[-2000:])
    try:
        yield ["-include", str(header)]
    finally:
        precompiled.unlink(missing_ok=True)


@dataclass(frozen=True)
class KernelConstants:
    """The numbers the C++ kernels choose by, read from the build (csrc/cpu_ops.h defines them
    once): activation rows up to which a linear takes each kernel, and the native layer loop's
    linear kinds by name."""

    gemv_max_rows: int  # bf16: the most rows the GEMV takes at once; a linear takes it up to gemv_max_rows(K)
    gemm_max_rows: int  # and the GEMM beyond, up to here; F.linear (oneDNN) past it
    gemm_row_block: int  # the GEMM computes x's rows this many at a time
    int8_gemv_max_rows: int  # INT8 codes: the GEMV up to here
    int4_gemv_max_rows: int  # INT4 codes (PyTorch's packed layout): dabba's GEMV up to here, a GEMM beyond
    int8_gemm_min_rows: int  # INT8's GEMM from here to gemm_max_rows (bf16 activations)
    int8_dequant_min_rows: int  # past the GEMM (or float32 from here) INT8 dequantizes its codes
    amx_gemv_max_rows: int  # where the GEMM runs on AMX tiles (amx_usable): the GEMV only up to here
    amx_int8_gemm_min_rows: int  # and INT8's GEMM from here
    avx2_gemm_min_rows: int  # the avx2 build: bf16's GEMM (csrc/gemm_avx2_cpu.cpp) from here, the GEMV below
    w8a8_columns: int  # W8A8's packed weight: blocks of this many output channels ...
    w8a8_depth: int  # ... with K padded to a multiple of this (csrc/w8a8_cpu.cpp)
    w8a8_max_inputs: int  # the most inputs its int32 sums hold
    amx_w8a8_min_rows: int  # W8A8 on AMX-INT8 tiles from here, where the CPU has them
    linear_kinds: dict[str, int]  # "dense", "int8", "int4", "gguf", "w8a8", ... -> LinearKind in csrc/cpu_ops.h
    gguf_types: dict[str, int]  # the GGUF types the kernels take, by name -> ggml's type id (csrc/gguf_blocks.h)


@functools.lru_cache(maxsize=None)
def kernel_constants() -> KernelConstants | None:
    """None where the kernels could not be built (nothing then chooses by these numbers)."""
    if not load_cpu_ops():
        return None
    raw = dict(torch.ops.dabba_cpu.kernel_constants())
    def named(prefix: str) -> dict[str, int]:
        return {name.removeprefix(prefix): raw.pop(name) for name in list(raw) if name.startswith(prefix)}

    kinds, gguf_types = named("linear_kind."), named("gguf_type.")
    return KernelConstants(linear_kinds=kinds, gguf_types=gguf_types, **raw)


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


@functools.lru_cache(maxsize=None)
def dense_attention_available() -> bool:
    return load_cpu_ops() and torch.ops.dabba_cpu.dense_attention_available()


@functools.lru_cache(maxsize=None)
def avx2_gemm_available() -> bool:
    return load_cpu_ops() and torch.ops.dabba_cpu.avx2_gemm_available()


def amx_usable(in_features: int) -> bool:
    """Whether the GEMM runs on AMX tiles for this many input features here (csrc/gemm_amx_cpu.cpp):
    the CPU has AMX-BF16, the OS granted the tiles, and the features are a multiple of 32."""
    return gemm_available() and torch.ops.dabba_cpu.amx_usable(in_features)


def linear_row_blocks(in_features: int) -> tuple[int, int]:
    """(rows up to which each row costs its own, rows the kernel computes at a time beyond) for a
    bf16 linear with this many input features here: the GEMV, then the GEMM's blocks; (0, 1)
    where no blocking is known (the avx2 build's GEMM, or no kernels)."""
    if not gemm_available():
        return 0, 1
    return gemv_max_rows(in_features), kernel_constants().gemm_row_block


def gemv_max_rows(in_features: int) -> int:
    """Rows of x up to which a bf16 linear with this many input features takes the GEMV rather than
    the GEMM here (csrc/cpu_ops.h: fewer for wide inputs, none on AMX tiles)."""
    return int(torch.ops.dabba_cpu.gemv_max_rows(in_features)) if gemm_available() else 0


def gguf_gemv_max_rows(in_features: int) -> int:
    """Rows of x up to which a GGUF linear with this many input features takes the GEMV, a GEMM beyond (csrc/cpu_ops.h: decode's few where the GEMM has AMX tiles, more without)."""
    return int(torch.ops.dabba_cpu.gguf_gemv_max_rows(in_features)) if load_cpu_ops() else 0


def integer_gemm_usable(in_features: int) -> bool:
    """Whether a GGUF, INT4 or INT8 linear's rows past its GEMV take the integer GEMM here (x's 8-bit
    codes times the weight's codes, AVX512-VNNI without AMX tiles: csrc/code_gemm.h) rather than the
    weight dequantized or widened per call (csrc/cpu_ops.h)."""
    return bool(torch.ops.dabba_cpu.integer_gemm_usable(in_features)) if load_cpu_ops() else False


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with bf16 rows on the CPU through dabba's kernels: the GEMV for decode's few rows
    (it streams the weight at close to memory bandwidth, oneDNN at about half of it) and the GEMM
    beyond, up to gemm_max_rows (1.3-2x oneDNN's as PyTorch calls it; csrc/gemm_cpu.cpp). On AMX
    tiles, where the CPU has them, the GEMM takes every row count from one. Long prefills and
    other cases keep F.linear. The avx2 build runs its own GEMM from avx2_gemm_min_rows rows
    (csrc/gemm_avx2_cpu.cpp), at any row count."""
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
    decode's few rows (csrc/int8_gemv_cpu.cpp); past it bf16 rows without AMX tiles take the integer
    GEMM (csrc/int8_code_gemm_cpu.cpp; integer_gemm_usable); elsewhere the GEMM on codes widened to
    bf16 from int8_gemm_min_rows to gemm_max_rows (csrc/gemm_cpu.cpp; KernelConstants), codes
    dequantized + linear for long prefills, else PyTorch's _weight_int8pack_mm (the avx2 build,
    without the GEMM: the GEMV for any count of bf16 rows). None off the CPU or without the native
    kernels."""
    if x.dim() == 2 and x.device.type == "cpu" and load_cpu_ops():
        return torch.ops.dabba_cpu.int8_linear(x, codes, scales, bias)
    return None
