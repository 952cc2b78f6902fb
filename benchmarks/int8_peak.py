"""The machine's peak rate of 8-bit integer dot products, what W8A8's GEMMs (csrc/w8a8_cpu.cpp) are
built from: vpdpbusd chains (AVX512-VNNI: 64 multiply-adds an instruction) on every thread, and
TDPBUSD chains on AMX-INT8 tiles (16 x 16 x 64 an instruction) where the CPU and the OS have them.
Prints JSON, in GOP/s (a multiply-add is 2 operations, as compute_peak counts flops), and the share
of that peak W8A8's GEMM reaches on the linears of the 1B-1.5B models at ``--rows`` rows (the
peak of the path w8a8_path chooses there: AMX-INT8's where the CPU has it, else VNNI's).

    python -m benchmarks.int8_peak [--seconds 1] [--rows 4096] [--repeats 3]
"""
from __future__ import annotations

import argparse
import functools
import json
import time
from typing import Any, Callable

import torch

from dabba.ops import kernel_variants

PROBE_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

// {operations per instruction, instructions per thread, a sum that keeps the chains live}; 0
// operations where this build has no such instruction.
std::vector<double> vnni_probe(int64_t iters) {
  double ops = 0.0, sink = 0.0;
#if defined(__AVX512VNNI__)
  constexpr int kChains = 16;  // latency x throughput, and few enough that GCC keeps them in registers
#pragma omp parallel reduction(+ : sink)
  {
    __m512i acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_setzero_si512();
    __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(1);
    for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 16
      for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
      __asm__ volatile("" : "+v"(a), "+v"(b));
    }
    for (int i = 0; i < kChains; ++i) sink += _mm512_reduce_add_epi32(acc[i]);
  }
  ops = 128.0;  // 16 lanes x 4 products x (multiply + add)
  return {ops, static_cast<double>(iters) * kChains, sink};
#else
  return {ops, 0.0, sink};
#endif
}

std::vector<double> amx_int8_probe(int64_t iters) {
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1)) return {0.0, 0.0, 0.0};
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return {0.0, 0.0, 0.0};  // the tile data state
  struct alignas(64) Config {
    uint8_t palette = 1, start = 0, reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  };
  double sink = 0.0;
#pragma omp parallel reduction(+ : sink)
  {
    static const Config config;
    alignas(64) int8_t operand[1024];
    for (int i = 0; i < 1024; ++i) operand[i] = 1;
    alignas(64) int32_t out[256];
    _tile_loadconfig(&config);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, operand, 64); _tile_loadd(5, operand, 64);
    _tile_loadd(6, operand, 64); _tile_loadd(7, operand, 64);
    for (int64_t it = 0; it < iters; ++it) {  // four independent accumulators, as a 2 x 2 GEMM step
      _tile_dpbusd(0, 4, 6); _tile_dpbusd(1, 4, 7); _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7);
    }
    _tile_stored(0, out, 64);
    sink += out[0];
    _tile_release();
  }
  return {32768.0, static_cast<double>(iters) * 4, sink};  // 16 x 16 x 64 products x 2
#else
  return {0.0, 0.0, 0.0};
#endif
}
"""


@functools.lru_cache(maxsize=None)
def _probe_module() -> Any:
    from torch.utils.cpp_extension import load_inline

    variant = kernel_variants.running_variant()
    return load_inline(name=f"dabba_int8_probe_{variant.name}", cpp_sources=[PROBE_SOURCE],
                       functions=["vnni_probe", "amx_int8_probe"],
                       extra_cflags=[*kernel_variants.COMMON_CFLAGS, *variant.cflags],
                       extra_ldflags=list(kernel_variants.COMMON_LDFLAGS))


def _best_rate(probe: Callable[[int], list[float]], seconds: float) -> float | None:
    """The best GOP/s of ``probe`` over rounds of about a tenth of ``seconds``, all threads; None
    where the build or the CPU lacks its instruction."""
    iters, best = 1000, 0.0
    deadline = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        ops, per_thread, _ = probe(iters)
        elapsed = time.perf_counter() - start
        if ops == 0.0:
            return None
        best = max(best, ops * per_thread * torch.get_num_threads() / elapsed / 1e9)
        if elapsed < seconds / 10:
            iters *= 2
        if time.perf_counter() > deadline:
            return best


def measure_int8_peak(seconds: float = 1.0) -> dict[str, Any]:
    variant = kernel_variants.running_variant()
    result: dict[str, Any] = {"variant": variant.name, "threads": torch.get_num_threads()}
    if variant.name != "avx512":
        return {**result, "vnni_gops": None, "amx_int8_gops": None}
    module = _probe_module()
    return {**result, "vnni_gops": _best_rate(module.vnni_probe, seconds),
            "amx_int8_gops": _best_rate(module.amx_int8_probe, seconds)}


# (in, out) of the MLP's up and down projections: Llama-3.2-1B, Qwen2.5-1.5B, Gemma-3-1B
GEMM_SHAPES = ((2048, 8192), (8192, 2048), (1536, 8960), (8960, 1536), (1152, 6912), (6912, 1152))


def measure_gemm(rows: int, in_features: int, out_features: int, repeats: int, path: str = "") -> dict[str, Any]:
    """W8A8's GEMM (bf16 x, random INT8 codes) on one shape, on ``path`` ("": the one w8a8_path
    chooses; "amx", "vnni", ...: where kAmxW8A8MinRows is set): the best of ``repeats`` GOP/s."""
    from dabba.quantization.w8a8 import pack_weight, w8a8_linear

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (out_features, in_features), generator=g, dtype=torch.int8)
    packed, wsum = pack_weight(codes), codes.to(torch.int32).sum(1, dtype=torch.int32)
    scales = torch.rand(out_features, generator=g) * 1e-3
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    w8a8_linear(x, packed, wsum, scales, None, False, path)  # first touch
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        w8a8_linear(x, packed, wsum, scales, None, False, path)
        best = min(best, time.perf_counter() - start)
    return {"in": in_features, "out": out_features, "path": path or torch.ops.dabba_cpu.w8a8_path(rows, in_features),
            "ms": best * 1e3, "gops": 2 * rows * in_features * out_features / best / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=1.0, help="how long each probe runs (default 1)")
    parser.add_argument("--rows", type=int, default=4096, help="the GEMMs' rows (default 4096; 0: no GEMMs)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each GEMM, the best kept (default 3)")
    args = parser.parse_args()
    result = measure_int8_peak(args.seconds)
    if args.rows > 0:
        from dabba.ops import native
        from dabba.worker.memory import keep_freed_host_memory

        keep_freed_host_memory()  # as the engine allocates its activations

        if not native.load_cpu_ops():
            raise SystemExit("int8_peak: the native kernels are not available")
        gemms = [measure_gemm(args.rows, k, n, args.repeats) for k, n in GEMM_SHAPES]
        for gemm in gemms:
            peak = result["amx_int8_gops"] if gemm["path"] == "amx" else result["vnni_gops"]
            gemm["share_of_peak"] = gemm["gops"] / peak if peak else None
        result["gemm_rows"], result["gemms"] = args.rows, gemms
    print(json.dumps(result))


if __name__ == "__main__":
    main()
