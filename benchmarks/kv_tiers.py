"""Time to first token of a long prompt recomputed, against the same prompt's prefix read from the
disk tier by a restarted engine (each run a fresh process over one --kv-offload-dir). Prints one
JSON object:

    python -m benchmarks.peers.make_shapes --shapes qwen2.5-0.5b --no-gguf   # /tmp/shapes/qwen2.5-0.5b
    python -m benchmarks.kv_tiers --model /tmp/shapes/qwen2.5-0.5b [--prompt-len 8192]

The issue's bar: the restarted engine's first token at most 0.2x the recompute's. (The multi-turn
agent workload is not here yet.)
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile

from benchmarks.vision_ttft import _cpu_name

RUN = r'''
import json, random, sys, time
from dabba import LLM, SamplingParams
from dabba.config_fields import parse_bytes
model, disk, n, kv, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), parse_bytes(sys.argv[4]), sys.argv[5]
llm = LLM(model, dtype=dtype, kv_cache_memory=kv, kv_offload_memory=kv, kv_offload_dir=disk,
          max_num_batched_tokens=2048)
vocab = llm.llm_engine.model_info.vocab_size
rng = random.Random(0)
prompt = [rng.randrange(10, vocab - 10) for _ in range(n)]
llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=1), use_tqdm=False)  # the first step's buffers
start = time.perf_counter()
out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)[0]
ttft = time.perf_counter() - start
llm.llm_engine.engine_core.model_runner.host_tier.disk.flush()  # what it wrote is on disk before it exits
stats = llm.get_stats()
print(json.dumps({"ttft_s": round(ttft, 3), "cached_tokens": out.num_cached_tokens,
                  "disk_hit_blocks": stats.kv_offload_disk_hit_blocks, "disk_bytes": stats.kv_offload_disk_bytes}))
'''


def run(model: str, prompt_len: int, kv_memory: str, dtype: str) -> dict:
    disk = tempfile.mkdtemp(prefix="dabba-kv-tiers-")
    try:
        runs = {}
        for label in ("recompute", "restart_from_disk"):
            out = subprocess.run([sys.executable, "-c", RUN, model, disk, str(prompt_len), kv_memory, dtype],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"the {label} run failed: {out.stderr[-2000:]}")
            runs[label] = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    return {"benchmark": "kv_tiers", "cpu": _cpu_name(), "model": model, "prompt_len": prompt_len, **runs,
            "ttft_ratio": round(runs["restart_from_disk"]["ttft_s"] / runs["recompute"]["ttft_s"], 3)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--kv-memory", default="1GiB", help="the KV pool and the memory tier, each")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.model, args.prompt_len, args.kv_memory, args.dtype)))


if __name__ == "__main__":
    main()
