"""dabba's native CPU kernels against what PyTorch would run in their place, side by side in one
process, on a model's layer shapes (SmolLM2-135M's by default). Prints JSON. The figures quoted in
dabba/csrc's comments come from here.

    python -m benchmarks.kernels [--layers 30 --repeats 5]

- linear: one pass over every layer's weights (cold: more bytes than the caches hold) at 1-4096
  rows: dabba's bf16 linear (each linear the GEMV to native.gemv_max_rows(K) rows, fewer for wide
  inputs, the GEMM to gemm_max_rows: "gemm+gemv" where the layer's linears take both; on AMX tiles
  the GEMM from one row, and the GEMV timed beside it up to gemv_max_rows; the avx2 build the GEMV
  below avx2_gemm_min_rows, its own GEMM from there) against F.linear, GB/s of weights and
  GFLOP/s; its INT8 linear (GEMV, then GEMM on codes widened to bf16) against _weight_int8pack_mm.
  Each row names the kernel that took it and whether its outputs agreed with the op it is timed
  against (a wrong kernel's timing means nothing).
- int8_prefill: the INT8 linear at prefill's row counts, _weight_int8pack_mm against codes
  dequantized per call + dabba's linear (what rows past gemm_max_rows get).
- int4_prefill: the INT4 linear at prefill's row counts, int4_linear as chosen (the integer GEMM
  without AMX tiles, the AMX GEMM with them) against tinygemm and against dabba's bf16 linear on the
  weight the codes mean (what the bf16 checkpoint's layer runs).
- attention: decode over --decode-seqs sequences of --decode-context positions (blocks shuffled, as
  a long-running server's are, and in order), and one prompt of each --prompt-lens, per layer: as
  the backend runs it (layer_us: its bf16 passes on AMX tiles where the CPU has them and
  attention_on_amx in csrc/paged_attention_cpu.cpp takes them) and on the AVX512-BF16 passes, the
  reference (reference_layer_us), with the GFLOP/s of each (QK^T and PV of the causal prompt).
- encoder_attention: one image's (or text's) unmasked attention over --encoder-lens tokens at the
  shape's heads and head_dim (a vision tower's: --num-heads 16 --head-dim 72 for SigLIP so400m,
  80 for Qwen2.5-VL's), layers/encoder_attention.dense_attention as chosen (the native tiles for
  bf16 where the CPU has bf16 dot products) against SDPA on the same bf16 inputs, GFLOP/s of each.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class Shape:
    hidden: int = 576
    intermediate: int = 1536
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16

    def linears(self) -> list[tuple[int, int]]:
        """(out, in) of a layer's qkv, o, gate_up and down projections."""
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return [(qkv, self.hidden), (self.hidden, self.num_heads * self.head_dim),
                (2 * self.intermediate, self.hidden), (self.hidden, self.intermediate)]


def best_ms(fn: Callable[[], Any], repeats: int) -> float:
    """The second-best of ``repeats`` timed calls after two warm-ups (the best is often an outlier)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[min(1, len(times) - 1)] * 1e3


def agree(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    """Equal up to bf16 rounding of differently ordered sums: within 2% of each output's largest."""
    return all(bool((g.float() - w.float()).abs().max() <= 0.02 * w.float().abs().max()) for g, w in zip(got, want))


def bench_linear(shape: Shape, layers: int, rows: list[int], repeats: int) -> list[dict[str, Any]]:
    from dabba.ops import native

    limits = native.kernel_constants()
    linears = shape.linears()
    dense = [[torch.randn(n, k).bfloat16() for n, k in linears] for _ in range(layers)]
    codes = [[(torch.randint(-127, 128, (n, k), dtype=torch.int8), (torch.rand(n) / 100).bfloat16())
              for n, k in linears] for _ in range(layers)]
    weights = sum(n * k for n, k in linears) * layers  # elements per pass
    amx = native.amx_usable(shape.hidden)  # the GEMM on AMX tiles, and the thresholds that go with it
    int8_gemm_min_rows = limits.amx_int8_gemm_min_rows if amx else limits.int8_gemm_min_rows
    gemm = "gemm_amx" if amx else "gemm"
    has_gemm = native.gemm_available()  # the avx2 build has its own bf16 GEMM, and the INT8 GEMV at every row count
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k).bfloat16() for _, k in linears}
        row: dict[str, Any] = {"rows": m}
        row["bf16_f_linear_ms"] = best_ms(lambda: [F.linear(xs[w.shape[1]], w) for layer in dense for w in layer], repeats)
        if native.gemv_available():
            if has_gemm:
                # per linear: the GEMV while its rows of x fit (native.gemv_max_rows(K)), then the GEMM
                kernels = {"gemv" if m <= native.gemv_max_rows(k) else gemm if m <= limits.gemm_max_rows
                           else "f_linear" for _, k in linears}
                row["bf16_kernel"] = "+".join(sorted(kernels))
            else:
                row["bf16_kernel"] = "gemm_avx2" if m >= limits.avx2_gemm_min_rows and native.avx2_gemm_available() \
                    else "gemv"
            row["bf16_agrees"] = agree([native.linear(xs[w.shape[1]], w) for w in dense[0]],
                                       [F.linear(xs[w.shape[1]], w) for w in dense[0]])
            row["bf16_native_ms"] = best_ms(
                lambda: [native.linear(xs[w.shape[1]], w) for layer in dense for w in layer], repeats)
            row["bf16_native_gb_s"] = 2 * weights / row["bf16_native_ms"] / 1e6
            if m <= limits.gemv_max_rows:  # the GEMV itself, where AMX tiles take these rows instead
                outs = {n: torch.empty(m, n, dtype=torch.bfloat16) for n, _ in linears}
                row["bf16_gemv_ms"] = best_ms(lambda: [torch.ops.dabba_cpu.bf16_gemv(
                    outs[w.shape[0]], xs[w.shape[1]], w, None) for layer in dense for w in layer], repeats)
            row["bf16_native_gflop_s"] = 2 * m * weights / row["bf16_native_ms"] / 1e6
        row["int8_pack_mm_ms"] = best_ms(
            lambda: [torch.ops.aten._weight_int8pack_mm(xs[q.shape[1]], q, s) for layer in codes for q, s in layer],
            repeats)
        if native.int8_gemv_available():
            row["int8_kernel"] = ("gemv" if m <= limits.int8_gemv_max_rows or not has_gemm else "pack_mm"
                                  if m < int8_gemm_min_rows else gemm if m <= limits.gemm_max_rows
                                  else "dequantize_linear")
            row["int8_agrees"] = agree([native.int8_linear(xs[q.shape[1]], q, s) for q, s in codes[0]],
                                       [torch.ops.aten._weight_int8pack_mm(xs[q.shape[1]], q, s) for q, s in codes[0]])
            row["int8_native_ms"] = best_ms(
                lambda: [native.int8_linear(xs[q.shape[1]], q, s) for layer in codes for q, s in layer], repeats)
            row["int8_native_gb_s"] = weights / row["int8_native_ms"] / 1e6
        out.append(row)
    return out


def bench_int8_prefill(shape: Shape, layers: int, rows: list[int], repeats: int) -> list[dict[str, Any]]:
    from dabba.ops import native

    codes = [[(torch.randint(-127, 128, (n, k), dtype=torch.int8), (torch.rand(n) / 100).bfloat16())
              for n, k in shape.linears()] for _ in range(layers)]
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k).bfloat16() for _, k in shape.linears()}
        packed = best_ms(lambda: [torch.ops.aten._weight_int8pack_mm(xs[q.shape[1]], q, s)
                                  for layer in codes for q, s in layer], repeats)
        dequantized = best_ms(lambda: [native.linear(xs[q.shape[1]], q.to(torch.bfloat16) * s[:, None])
                                       for layer in codes for q, s in layer], repeats)
        agrees = agree([native.linear(xs[q.shape[1]], q.to(torch.bfloat16) * s[:, None]) for q, s in codes[0]],
                       [torch.ops.aten._weight_int8pack_mm(xs[q.shape[1]], q, s) for q, s in codes[0]])
        out.append({"rows": m, "int8_pack_mm_ms": packed, "dequantize_linear_ms": dequantized, "agrees": agrees})
    return out


def bench_int4_prefill(shape: Shape, layers: int, rows: list[int], repeats: int,
                       group_size: int = 32) -> list[dict[str, Any]]:
    """The INT4 linear at prefill's row counts: int4_linear as it chooses here, PyTorch's tinygemm,
    and the bf16 linear on the weight the codes mean, (q - 8) * scale + zero."""
    from dabba.ops import native

    g = torch.Generator().manual_seed(0)
    weights = []
    for _ in range(layers):
        for n, k in shape.linears():
            codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
            pairs = torch.stack([torch.rand(k // group_size, n, generator=g) / 100,
                                 torch.randn(k // group_size, n, generator=g) / 100], dim=-1)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            pairs = pairs.bfloat16().contiguous()
            s = pairs.float().transpose(0, 1).repeat_interleave(group_size, dim=1)  # [n, k, 2]
            dense = ((codes - 8).float() * s[..., 0] + s[..., 1]).bfloat16()
            weights.append((packed, pairs, k, dense))
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k).bfloat16() for _, _, k, _ in weights}
        tinygemm = lambda w: torch.ops.aten._weight_int4pack_mm_for_cpu(xs[w[2]], w[0], group_size, w[1])  # noqa: E731
        chosen = lambda w: torch.ops.dabba_cpu.int4_linear(xs[w[2]], w[0], group_size, w[1], None, True)  # noqa: E731
        bf16 = lambda w: native.linear(xs[w[2]], w[3])  # noqa: E731
        out.append({
            "rows": m, "tinygemm_ms": best_ms(lambda: [tinygemm(w) for w in weights], repeats),
            "int4_linear_ms": best_ms(lambda: [chosen(w) for w in weights], repeats),
            "bf16_linear_ms": best_ms(lambda: [bf16(w) for w in weights], repeats),
            "agrees": agree([chosen(w) for w in weights[:4]] * 2,
                            [tinygemm(w) for w in weights[:4]] + [bf16(w) for w in weights[:4]]),
        })
    return out


def _attention_case(shape: Shape, query_lens: list[int], context_lens: list[int], shuffle: bool,
                    seed: int = 0, amx: bool = True) -> tuple[Callable[[], Any], int]:
    """One layer's CPU-backend attention for a step of these requests; returns (run, KV bytes read).
    amx False: a step with prompts forced onto the AVX512-BF16 passes (the paged_attention op's amx
    argument), the reference."""
    from dabba.attention.backend import CommonAttentionMetadata
    from dabba.attention.cpu import CpuBackend

    rng = np.random.default_rng(seed)
    bs = shape.block_size
    seq_lens = np.array(context_lens) + np.array(query_lens)
    blocks_needed = [-(-int(n) // bs) for n in seq_lens]
    total = sum(blocks_needed)
    ids = rng.permutation(total) if shuffle else np.arange(total)
    table = np.zeros((len(seq_lens), max(blocks_needed)), dtype=np.int64)
    pos = 0
    for i, n in enumerate(blocks_needed):
        table[i, :n] = ids[pos:pos + n]
        pos += n
    slots = np.concatenate([table[i, p // bs] * bs + p % bs
                            for i, (c, s) in enumerate(zip(context_lens, seq_lens)) for p in [np.arange(c, s)]])
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    common = CommonAttentionMetadata(qsl, seq_lens.astype(np.int64), table, torch.from_numpy(slots), bs,
                                     torch.device("cpu"))
    backend = CpuBackend()
    metadata = backend.build_metadata(common)
    cache = torch.randn(backend.kv_cache_shape(total, bs, shape.num_kv_heads, shape.head_dim)).bfloat16()
    tokens = int(qsl[-1])
    q = torch.randn(tokens, shape.num_heads, shape.head_dim).bfloat16()
    k = torch.randn(tokens, shape.num_kv_heads, shape.head_dim).bfloat16()
    v = torch.randn(tokens, shape.num_kv_heads, shape.head_dim).bfloat16()
    kv_bytes = int(2 * seq_lens.sum() * shape.num_kv_heads * shape.head_dim * 2)
    scale = shape.head_dim ** -0.5
    if amx or metadata.decode_only:
        return (lambda: backend.forward(q, k, v, cache, metadata, scale)), kv_bytes

    def reference() -> torch.Tensor:  # backend.forward's steps, the op told to keep off AMX tiles
        key_cache, value_cache = backend.split_cache(cache)
        backend.write_kv(key_cache, value_cache, k, v, metadata)
        out = torch.empty_like(q)
        torch.ops.dabba_cpu.paged_attention(out, q, key_cache, value_cache, metadata.block_table,
                                            metadata.query_start_loc, metadata.seq_lens, scale, 0, 0.0, None, None,
                                            False)
        return out

    return reference, kv_bytes


def bench_attention(shape: Shape, layers: int, decode_seqs: int, decode_context: int, prompt_lens: list[int],
                    repeats: int) -> dict[str, Any]:
    from dabba.ops import native

    if not native.load_cpu_ops():
        return {"skipped": "native kernels unavailable"}
    out: dict[str, Any] = {}
    for order in ("shuffled", "in_order"):
        cases = [_attention_case(shape, [1] * decode_seqs, [decode_context - 1] * decode_seqs, order == "shuffled",
                                 seed=i) for i in range(layers)]  # a cache per layer: cold, as in a step
        ms = best_ms(lambda: [run() for run, _ in cases], repeats)
        out[f"decode_{order}"] = {"seqs": decode_seqs, "context": decode_context, "layers": layers, "step_ms": ms,
                                  "kv_gb_s": sum(b for _, b in cases) / ms / 1e6}
    out["prompt"] = []
    for n in prompt_lens:
        flops = 4 * shape.num_heads * shape.head_dim * n * (n + 1) / 2  # QK^T and PV over the causal keys
        row: dict[str, Any] = {"tokens": n}
        for name, amx in (("layer_us", True), ("reference_layer_us", False)):
            run, _ = _attention_case(shape, [n], [0], shuffle=False, amx=amx)
            row[name] = best_ms(run, repeats) * 1e3
        row["gflop_s"] = flops / row["layer_us"] / 1e3
        row["reference_gflop_s"] = flops / row["reference_layer_us"] / 1e3
        out["prompt"].append(row)
    return out


def bench_encoder_attention(shape: Shape, lens: list[int], repeats: int) -> list[dict[str, Any]]:
    from dabba.layers.encoder_attention import dense_attention
    from dabba.ops import native

    rows = []
    for n in lens:
        q, k, v = (torch.randn(1, shape.num_heads, n, shape.head_dim, dtype=torch.bfloat16) for _ in range(3))
        scale = shape.head_dim ** -0.5
        flops = 4.0 * shape.num_heads * shape.head_dim * n * n
        ours = best_ms(lambda: dense_attention(q, k, v, scale), repeats)
        sdpa = best_ms(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale), repeats)
        want = F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2)
        rows.append({"tokens": n, "kernel": "native" if native.dense_attention_available() else "sdpa",
                     "ms": ours, "sdpa_ms": sdpa, "gflop_s": flops / ours / 1e6, "sdpa_gflop_s": flops / sdpa / 1e6,
                     "agrees": agree([dense_attention(q, k, v, scale)], [want])})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--linear-rows", default="1,2,4,6,8,10,12,16,32,64,128,256")
    parser.add_argument("--prefill-rows", default="32,64,128,512")
    parser.add_argument("--decode-seqs", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=300)
    parser.add_argument("--prompt-lens", default="128,256,512,2048")
    parser.add_argument("--encoder-lens", default="1024,4096")
    for field, default in asdict(Shape()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=default)
    args = parser.parse_args(argv)
    shape = Shape(**{f: getattr(args, f) for f in asdict(Shape())})
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    result = {
        "shape": asdict(shape), "layers": args.layers, "threads": torch.get_num_threads(),
        "linear": bench_linear(shape, args.layers, ints(args.linear_rows), args.repeats),
        "int8_prefill": bench_int8_prefill(shape, args.layers, ints(args.prefill_rows), args.repeats),
        "int4_prefill": bench_int4_prefill(shape, args.layers, ints(args.prefill_rows), args.repeats),
        "attention": bench_attention(shape, args.layers, args.decode_seqs, args.decode_context,
                                     ints(args.prompt_lens), args.repeats),
        "encoder_attention": bench_encoder_attention(shape, ints(args.encoder_lens), args.repeats),
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
