"""What data parallelism gives on one host: `dabba serve --data-parallel-size N` (each replica's
model in a worker process on its share of the cores) against one engine with all the cores,
both driven by `dabba bench serve`'s client, in alternating rounds, a fresh server each time.
Two workloads: "random" (no prompt shares a block) and "prefixes" (each prompt starts with one
of a few long shared prefixes: the router should send each prefix's requests to one replica,
so that the replicas' prefix-cache hit rate stays near one engine's). Prints JSON: each round's
figures, the prefix-cache hit rate from /metrics, and the ratios of the medians.

    python -m benchmarks.dp_scaling [--model DIR] [--dp 2] [--rounds 2] [--num-prompts 32]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import time
from typing import Iterator

import httpx

from dabba.config import DEMO_MODEL
from dabba.tools.bench.serve import ServeBenchConfig, run_serve_benchmark

WORKLOADS = {"random": dict(input_len=256, output_len=64),
             "prefixes": dict(prefix_len=256, num_prefixes=4, input_len=32, output_len=64)}


@contextlib.contextmanager
def server(model: str, dp: int, extra: list[str]) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", "import sys; from dabba.entrypoints.cli import main; sys.exit(main())", "serve",
           model, "--port", str(port), "--data-parallel-size", str(dp), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def prefix_cache(url: str) -> tuple[int, int]:
    """Prompt tokens served from the prefix cache, and looked up, since the server started (the
    replicas' sums)."""
    stats = httpx.get(f"{url}/engine/stats").json()["prefix_cache"]
    return stats["hit_tokens"], stats["queried_tokens"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEMO_MODEL)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--workloads", default="random,prefixes")
    p.add_argument("--serve-args", default="", help="more `dabba serve` flags, e.g. '--dtype float32'")
    args = p.parse_args()
    workloads = args.workloads.split(",")
    rows = []
    for round_ in range(args.rounds):
        for dp in (1, args.dp):
            with server(args.model, dp, args.serve_args.split()) as url:
                for k, name in enumerate(workloads):  # a seed each: no workload's prompts are another's
                    cfg = ServeBenchConfig(base_url=url, num_prompts=args.num_prompts, seed=1000 * round_ + k,
                                           max_concurrency=args.max_concurrency, tokenizer=args.model, **WORKLOADS[name])
                    hit0, queried0 = prefix_cache(url)
                    result = asyncio.run(run_serve_benchmark(cfg))
                    hit, queried = prefix_cache(url)
                    assert result["failed"] == 0, result["errors"]
                    row = {"round": round_, "dp": dp, "workload": name,
                           "total_token_throughput": round(result["total_token_throughput"], 1),
                           "output_throughput": round(result["output_throughput"], 1),
                           "median_ttft_ms": round(result["ttft_ms"]["median"], 1),
                           "median_tpot_ms": round(result["tpot_ms"]["median"], 2),
                           "prefix_cache_hit_rate": round((hit - hit0) / max(queried - queried0, 1), 3)}
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
    summary = {}
    for name in workloads:
        def median(dp: int, key: str) -> float:
            return statistics.median(r[key] for r in rows if r["dp"] == dp and r["workload"] == name)

        summary[name] = {f"dp{args.dp}_over_dp1_throughput": round(median(args.dp, "total_token_throughput")
                                                                     / median(1, "total_token_throughput"), 3),
                         f"dp{args.dp}_over_dp1_tpot": round(median(args.dp, "median_tpot_ms")
                                                               / median(1, "median_tpot_ms"), 3)}
    print(json.dumps({"model": args.model, "rounds": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
