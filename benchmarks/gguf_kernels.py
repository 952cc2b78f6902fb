"""The GGUF GEMV and GEMM (csrc/gguf_linear_cpu.cpp) on a model's linear shapes, against the
machine's read bandwidth measured in the same process. Prints JSON.

    python -m benchmarks.gguf_kernels [--types Q4_K,Q6_K,Q8_0,Q4_0,INT8,INT4] [--layers 12] [--rows 1,2,4,8,16,64]

Each type's weights: --layers layers of one model's four linears (TinyLlama-1.1B's by default:
qkv, o, gate_up, down) in random blocks of that type (tools/random_gguf.py), more bytes than the
caches hold, so one pass over them is cold; the best of --repeats passes at each row count, as GB/s
of the blocks' bytes and the share of benchmarks.membw's best read. Beside the GGUF types, dabba's
own load-time formats on the same shapes: INT8 (codes and a scale per row: int8_linear) and INT4
(groups of 128 in PyTorch's packed layout with bf16 (scale, zero) pairs: int4_linear), random codes.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from benchmarks.membw import read_bandwidth
from dabba.ops import native
from dabba.ops.host_memory import on_huge_pages
from dabba.quantization.kernels import register_int4_for_cpu
from tools.random_gguf import random_blocks


def shapes(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """A decoder layer's linears as (rows, columns): qkv, o, gate_up, down."""
    return [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * intermediate, hidden),
            (hidden, intermediate)]


OWN_TYPES = ("INT8", "INT4")  # dabba's load-time formats (dabba.quantization.rtn)
INT4_GROUP = 128


def linears(type_name: str, layer_shapes: list[tuple[int, int]], layers: int) -> tuple[list, int]:
    """(calls: (fn(x), input width) per linear, bytes they read) for --layers layers of this type."""
    calls, nbytes = [], 0
    g = torch.Generator().manual_seed(0)
    for layer in range(layers):
        for i, (n, k) in enumerate(layer_shapes):
            if type_name == "INT8":
                q = on_huge_pages(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g))
                scales = (torch.rand(n, generator=g) * 0.01).to(torch.bfloat16)
                calls.append((lambda x, q=q, s=scales: torch.ops.dabba_cpu.int8_linear(x, q, s, None), k))
                nbytes += q.numel() + 2 * n
            elif type_name == "INT4":
                m = nn.Module()
                groups = k // INT4_GROUP
                register_int4_for_cpu(m, torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
                                      torch.rand(n, groups, generator=g) * 0.01,
                                      torch.randint(0, 16, (n, groups), generator=g).float(), torch.bfloat16)
                calls.append((lambda x, m=m: torch.ops.dabba_cpu.int4_linear(x, m.qweight, INT4_GROUP,
                                                                             m.scales_and_zeros, None), k))
                nbytes += m.qweight.numel() + 2 * m.scales_and_zeros.numel()
            else:
                type_id = native.kernel_constants().gguf_types[type_name]
                blob = random_blocks(type_name, n, k, seed=layer * len(layer_shapes) + i).data.reshape(-1)
                segments = torch.tensor([[type_id, n, 0]])
                calls.append((lambda x, b=blob, s=segments: torch.ops.dabba_cpu.gguf_linear(x, b, s, None), k))
                nbytes += blob.numel()
    return calls, nbytes


def measure(type_name: str, layer_shapes: list[tuple[int, int]], layers: int, rows: list[int], repeats: int,
            read_gb_s: float) -> dict:
    calls, nbytes = linears(type_name, layer_shapes, layers)
    result = {"type": type_name, "mb": round(nbytes / 1e6, 1), "rows": {}}
    for m in rows:
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {k for _, k in calls}}
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for fn, k in calls:
                fn(xs[k])
            best = min(best, time.perf_counter() - start)
        gb_s = nbytes / best / 1e9
        result["rows"][m] = {"ms": round(best * 1e3, 2), "gb_s": round(gb_s, 2),
                             "share_of_read": round(gb_s / read_gb_s, 3)}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q4_0")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rows", default="1,2,4,8,16,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--membw-gib", type=float, default=2.0)
    args = parser.parse_args(argv)
    if not native.load_cpu_ops():
        parser.error("the native CPU kernels are unavailable here")
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    known = [*native.kernel_constants().gguf_types, *OWN_TYPES]
    unknown = [t for t in types if t not in known]
    if unknown:
        parser.error(f"--types: unknown {unknown}; the kernels take {', '.join(known)}")
    read = max(read_bandwidth(int(args.membw_gib * 2**30), 3))
    layer_shapes = shapes(args.hidden, args.intermediate, args.num_heads, args.num_kv_heads, args.head_dim)
    rows = [int(r) for r in args.rows.split(",")]
    print(json.dumps({"variant": native.loaded_variant(), "threads": torch.get_num_threads(),
                      "read_gb_s": round(read, 2), "layer_shapes": layer_shapes, "layers": args.layers,
                      "types": [measure(t, layer_shapes, args.layers, rows, args.repeats, read) for t in types]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
