"""The machine's memory read bandwidth as decode meets it, and what share of it a decode reaches.
Prints JSON.

    python -m benchmarks.membw [--gib 2] [--iters 5] [--model DIR --decode-tok-s X]

Reads a buffer much larger than the caches with every thread PyTorch uses (a sum: one pass, no
writes, as a GEMV reads its weights), and reports the best and median GB/s over ``iters`` passes.
With ``--model`` and a measured batch-1 decode rate (``dabba bench latency``'s decode_tok_s), it
adds the bandwidth that decode reads the weights at (weight bytes x tokens/s, the KV cache left
out: it is small at batch 1) and its share of the measured peak.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def read_bandwidth(num_bytes: int, iters: int) -> list[float]:
    """GB/s of one full read of a ``num_bytes`` float32 buffer, ``iters`` times (after one warm-up)."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    x.sum()
    rates = []
    for _ in range(iters):
        start = time.perf_counter()
        x.sum()
        rates.append(num_bytes / (time.perf_counter() - start) / 1e9)
    return rates


def weight_bytes(model_dir: str) -> int:
    """Bytes of the checkpoint's tensors (safetensors headers only; no weight is read)."""
    from pathlib import Path

    from safetensors import safe_open

    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * {"BF16": 2, "F16": 2, "F32": 4, "I8": 1, "U8": 1, "I32": 4}[sl.get_dtype()]
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="buffer size (default 2 GiB)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--model", help="checkpoint directory whose weights a decode step reads")
    parser.add_argument("--decode-tok-s", type=float, help="its measured batch-1 decode tokens/s")
    args = parser.parse_args()
    rates = read_bandwidth(int(args.gib * 2**30), args.iters)
    result = {"threads": torch.get_num_threads(), "buffer_gib": args.gib, "read_gb_s_best": max(rates),
              "read_gb_s_median": statistics.median(rates)}
    if args.model:
        if args.decode_tok_s is None:
            parser.error("--model needs --decode-tok-s")
        wb = weight_bytes(args.model)
        decode_gb_s = wb * args.decode_tok_s / 1e9
        result.update({"model": args.model, "weight_bytes": wb, "decode_tok_s": args.decode_tok_s,
                       "decode_gb_s": decode_gb_s, "share_of_best": decode_gb_s / max(rates)})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
