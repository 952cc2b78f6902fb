"""Decode speed and weights memory of bf16, INT8 and INT4 (round to nearest) side by side in one
run, each in its own process, plus any pre-quantized checkpoints of the same model (GPTQ, AWQ).
Prints JSON with ratios against bf16.

Each format also reports the memory of loading it (engine construction in a fresh process): the
peak RSS (VmHWM) and PSS (sampled), and after the load what the process holds beyond its weights
and KV cache. ``--load-only`` skips the decode runs.

    python -m benchmarks.quantization --model /tmp/smollm     # e.g. a --make-smollm-shaped checkpoint
    python -m benchmarks.quantization --model dabba/assets/demo --checkpoint gptq=/tmp/demo-gptq
    python -m benchmarks.quantization --model /tmp/qwen25-1.5b --load-only
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

from benchmarks.throughput import PeakMemory, memory_mib, peak_rss_mib, random_prompts, run_isolated
from dabba.config_fields import parse_bytes

METHODS = (None, "int8", "int4")
MIB = 2**20


def load_memory(llm: Any, peak: PeakMemory, before: dict[str, float]) -> dict[str, Any]:
    """The load's peaks, and what the loaded engine holds beyond its weights and KV cache: the
    runtime before loading (Python, torch and dabba imported), RoPE tables, and the rest
    (tokenizer, native kernels, engine state, freed memory malloc keeps)."""
    runner = llm.llm_engine.engine_core.model_runner
    kv_bytes = sum(t.nbytes for c in runner.kv_caches for t in (c if isinstance(c, tuple) else (c,)))
    rope_bytes = sum(b.nbytes for n, b in runner.model.named_buffers() if "rotary" in n)
    after = memory_mib()
    weights, kv = runner.weight_bytes / MIB, kv_bytes / MIB
    beyond = after["rss"] - weights - kv
    return {
        "weights_mib": weights, "kv_cache_mib": kv,
        "load_peak_rss_mib": peak.peak["hwm_rss"], "load_peak_pss_mib": peak.peak["pss"],
        "load_peak_pss_file_mib": peak.peak["pss_file"],
        "load_peak_rss_beyond_weights_mib": peak.peak["hwm_rss"] - weights,
        "after_load": {
            "rss_mib": after["rss"], "pss_mib": after["pss"], "pss_file_mib": after["pss_file"],
            "beyond_weights_and_kv_rss_mib": beyond,
            "runtime_before_load_rss_mib": before["rss"], "rope_tables_mib": rope_bytes / MIB,
            "other_rss_mib": beyond - before["rss"] - rope_bytes / MIB,
        },
    }


def run_method(args: dict[str, Any], prompts: list[list[int]]) -> dict[str, Any]:
    from dabba import LLM, SamplingParams

    before = memory_mib()
    kv = {"kv_cache_memory": parse_bytes(args["kv_cache_memory"])} if args["kv_cache_memory"] else {}
    with PeakMemory() as peak:
        llm = LLM(args["path"], dtype="bfloat16", quantization=args["method"], **kv)
    result = load_memory(llm, peak, before)
    if args["load_only"]:
        return result
    params = SamplingParams(max_tokens=args["output_len"], temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    for batch in args["batch_sizes"]:
        best = 0.0
        for _ in range(args["repeats"]):
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts[:batch]], params, use_tqdm=False)
            best = max(best, batch * args["output_len"] / (time.perf_counter() - start))
        result[f"decode_tokens_per_s_batch{batch}"] = best
    result["peak_rss_mib"] = peak_rss_mib()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--input-len", type=int, default=16, help="short prompts: the time is decode")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--repeats", type=int, default=2, help="best of N runs per batch size")
    p.add_argument("--checkpoint", action="append", default=[], metavar="NAME=PATH",
                   help="also run a pre-quantized checkpoint of the same model (repeatable)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV budget per format, e.g. 1GiB (default: the engine's; 64MiB with --load-only, so "
                        "the peak is the load's, not the cache's)")
    p.add_argument("--load-only", action="store_true", help="measure loading memory only, no decode runs")
    args = p.parse_args()
    if args.load_only and args.kv_cache_memory is None:
        args.kv_cache_memory = "64MiB"
    runs: dict[str, tuple[str, str | None]] = {(m or "bf16"): (args.model, m) for m in METHODS}
    for spec in args.checkpoint:
        name, sep, path = spec.partition("=")
        if not sep or not path:
            p.error(f"--checkpoint takes NAME=PATH, got {spec!r}")
        runs[name] = (path, None)

    from pathlib import Path

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(max(args.batch_sizes), args.input_len, vocab, seed=0)
    report: dict[str, Any] = {"workload": {k: v for k, v in vars(args).items()}}
    for name, (path, method) in runs.items():
        report[name] = run_isolated("run_method", {**vars(args), "path": path, "method": method}, prompts)
    base = report["bf16"]
    report["ratios_vs_bf16"] = {
        m: {k: report[m][k] / base[k] for k in base if k.startswith(("decode", "weights", "load_peak_rss_mib",
                                                                     "load_peak_pss_mib"))}
        for m in runs if m != "bf16"}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
