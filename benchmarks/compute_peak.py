"""The machine's peak rate of the vector dot products that bf16 GEMMs are built from, and the least
time a batch workload's arithmetic can take at that rate. Prints JSON.

    python -m benchmarks.compute_peak [--seconds 1] [--model DIR --workload B32 [--total-tok-s X]]

A batch of prompts is bound by arithmetic, not by memory. Every engine does the same multiply-adds
for it: the linears for each prompt token and each decode step, the LM head for each sampled row,
and attention over each position's keys. Running them at the machine's peak rate gives the best
total tokens/s any engine can reach. A ratio target against a peer can exceed that ceiling divided
by the peer's rate; when it does, the target is out of reach on this machine, whatever the kernels.

The probe: every thread PyTorch uses runs independent chains of the running kernel variant's widest
dot product for ``--seconds`` (dabba/ops/kernel_variants.py picks the flags). On AVX-512 with BF16 that
is vdpbf16ps (64 flops per instruction); on AVX2 it is the float32 FMA that bf16 GEMMs widen to
(16). It is compiled on first use by torch's C++ extension loader. AMX tiles are faster than both,
so on a CPU with AMX the probe does not bound oneDNN's or dabba's AMX GEMMs: the report then says
so and gives no ceiling.
"""
from __future__ import annotations

import argparse
import functools
import json
import time
from typing import Any

import torch

from dabba.arch.config import ArchConfig
from dabba.ops import kernel_variants
from dabba.tools.bench.offline import OfflineWorkload

PROBE_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

// Chains of dot products with no loads: flops per second per thread, all threads at once.
// Returns {flops per instruction, instructions per thread, a sum that keeps the chains live}.
std::vector<double> dot_probe(int64_t iters) {
  constexpr int kChains = 24;  // enough independent accumulators to cover latency x throughput
  double flops_per_op = 0.0;
  float sink = 0.0f;
#pragma omp parallel reduction(+ : sink)
  {
#if defined(__AVX512BF16__)
    __m512 acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_setzero_ps();
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3c00);
    for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 24
      for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
      __asm__ volatile("" : "+v"(a), "+v"(b));  // keep the operands live: no hoisting
    }
    for (int i = 0; i < kChains; ++i) sink += _mm512_reduce_add_ps(acc[i]);
#pragma omp single
    flops_per_op = 64.0;  // 16 lanes x 2 products x (multiply + add)
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_setzero_ps();
    __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(1e-3f);
    for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 24
      for (int i = 0; i < kChains; ++i) acc[i] = _mm256_fmadd_ps(a, b, acc[i]);
      __asm__ volatile("" : "+x"(a), "+x"(b));
    }
    __m256 total = _mm256_setzero_ps();
    for (int i = 0; i < kChains; ++i) total = _mm256_add_ps(total, acc[i]);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, total);
    for (float v : lanes) sink += v;
#pragma omp single
    flops_per_op = 16.0;  // 8 lanes x (multiply + add)
#endif
  }
  return {flops_per_op, static_cast<double>(iters) * kChains, static_cast<double>(sink)};
}
"""
INSTRUCTIONS = {"avx512": "vdpbf16ps (AVX-512 BF16)", "avx2": "vfmadd float32 (AVX2 FMA)"}


@functools.lru_cache(maxsize=None)
def _probe_module() -> Any:
    from torch.utils.cpp_extension import load_inline

    variant = kernel_variants.running_variant()
    return load_inline(name=f"dabba_dot_probe_{variant.name}", cpp_sources=[PROBE_SOURCE], functions=["dot_probe"],
                       extra_cflags=[*kernel_variants.COMMON_CFLAGS, *variant.cflags],
                       extra_ldflags=list(kernel_variants.COMMON_LDFLAGS))


def has_amx() -> bool:
    try:
        return bool(torch.cpu.get_capabilities().get("amx_bf16"))
    except (AttributeError, RuntimeError):
        return False


def measure_peak(seconds: float = 1.0) -> dict[str, Any]:
    """The probe's best GFLOP/s over rounds of about a tenth of ``seconds`` each, all threads."""
    variant = kernel_variants.running_variant()
    result: dict[str, Any] = {"variant": variant.name, "threads": torch.get_num_threads(), "amx": has_amx()}
    if variant.name not in INSTRUCTIONS:
        return {**result, "instruction": None, "peak_gflops": None}
    probe = _probe_module().dot_probe
    iters, best = 1000, 0.0
    deadline = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        flops_per_op, ops_per_thread, _ = probe(iters)
        elapsed = time.perf_counter() - start
        best = max(best, flops_per_op * ops_per_thread * torch.get_num_threads() / elapsed / 1e9)
        if elapsed < seconds / 10:
            iters *= 2
        if time.perf_counter() > deadline:
            break
    return {**result, "instruction": INSTRUCTIONS[variant.name], "peak_gflops": best}


def linear_params_per_token(arch: ArchConfig) -> int:
    """Weights one token's forward multiplies in the decoder layers (a mixture of experts' routed
    layers: the router and top_k experts); the LM head and embedding left out."""
    from dabba.layers.linear import Linear
    from dabba.models.sizes import idle_expert_parameters, meta_model

    model = meta_model(arch, torch.bfloat16, None)
    total = sum(m.in_features * sum(m.output_sizes) for m in model.modules() if isinstance(m, Linear))
    return total - idle_expert_parameters(arch)


def _attended_keys(first: int, last: int, window: int | None) -> int:
    """Keys attended by the positions first..last-1 (position t sees t + 1, or its window)."""
    if window is None:
        return (last * (last + 1) - first * (first + 1)) // 2
    return sum(min(t + 1, window) for t in range(first, last))


def workload_flops(arch: ArchConfig, w: OfflineWorkload) -> dict[str, float]:
    """The multiply-adds (as 2 flops each) of ``w`` run with prefix caching: its shared prefix once,
    then each request's own prompt and its output_len - 1 decode steps (the last token sampled is
    never fed back); the LM head for each sampled row; attention at each position over its keys,
    per layer within that layer's window."""
    own_positions = w.input_len + w.output_len - 1
    tokens = w.prefix_len + w.num_prompts * own_positions
    linear = 2.0 * linear_params_per_token(arch) * tokens
    lm_head = 2.0 * arch.vocab_size * arch.hidden_size * w.num_prompts * w.output_len
    per_key = 4.0 * arch.num_attention_heads * arch.head_dim  # q.k and p.v, 2 flops each
    attention = 0.0
    for layer in range(arch.num_hidden_layers):
        window = arch.layer_sliding_window(layer)
        keys = _attended_keys(0, w.prefix_len, window)
        keys += w.num_prompts * _attended_keys(w.prefix_len, w.prefix_len + own_positions, window)
        attention += per_key * keys
    return {"linear": linear, "lm_head": lm_head, "attention": attention, "total": linear + lm_head + attention}


def ceiling(arch: ArchConfig, w: OfflineWorkload, peak: dict[str, Any]) -> dict[str, Any]:
    """The workload's flops and, where the probe bounds this CPU's GEMMs, the least time and the best
    total tokens/s (prompt + output tokens, as dabba bench throughput counts them) at the peak."""
    flops = workload_flops(arch, w)
    out: dict[str, Any] = {"flops": flops}
    if peak.get("peak_gflops") and not peak.get("amx"):
        seconds = flops["total"] / (peak["peak_gflops"] * 1e9)
        total_tokens = w.num_prompts * (w.prefix_len + w.input_len + w.output_len)
        out.update(seconds_at_peak=seconds, total_tok_s_at_peak=total_tokens / seconds)
    return out


def main() -> None:
    from benchmarks.peers.workloads import WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=1.0, help="how long the probe runs (default 1)")
    parser.add_argument("--model", help="checkpoint directory: report a workload's flops and its ceiling")
    parser.add_argument("--workload", default="B32", choices=sorted(WORKLOADS))
    parser.add_argument("--total-tok-s", type=float, help="a measured total tokens/s of that workload: its share "
                                                          "of the peak")
    args = parser.parse_args()
    peak = measure_peak(args.seconds)
    result: dict[str, Any] = {"peak": peak}
    if args.model:
        arch = ArchConfig.from_hf(args.model)
        w = WORKLOADS[args.workload].shape
        result[args.workload] = ceiling(arch, w, peak)
        if args.total_tok_s and "total_tok_s_at_peak" in result[args.workload]:
            result[args.workload]["share_of_peak"] = args.total_tok_s / result[args.workload]["total_tok_s_at_peak"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
