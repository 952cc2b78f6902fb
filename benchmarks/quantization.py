"""Decode speed and weights memory of bf16, INT8 and INT4 (round to nearest) side by side in one
run, each in its own process, plus any pre-quantized checkpoints of the same model (GPTQ, AWQ).
Prints JSON with ratios against bf16.

    python -m benchmarks.quantization --model /tmp/smollm     # e.g. a --make-smollm-shaped checkpoint
    python -m benchmarks.quantization --model dabba/assets/demo --checkpoint gptq=/tmp/demo-gptq
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

from benchmarks.throughput import peak_rss_mib, random_prompts, run_isolated

METHODS = (None, "int8", "int4")


def run_method(args: dict[str, Any], prompts: list[list[int]]) -> dict[str, Any]:
    from dabba import LLM, SamplingParams

    llm = LLM(args["path"], dtype="bfloat16", quantization=args["method"])
    params = SamplingParams(max_tokens=args["output_len"], temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    result = {"weights_mib": llm.llm_engine.model_runner.weight_bytes / 2**20}
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
    args = p.parse_args()
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
        m: {k: report[m][k] / base[k] for k in base if k.startswith(("decode", "weights"))} for m in runs if m != "bf16"}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
