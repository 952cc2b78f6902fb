"""dabba against vLLM's CPU build and llama.cpp on the issue's three workloads, side by side.

    python -m benchmarks.compare_peers --model DIR \\
        [--vllm-python /tmp/peers/vllm/bin/python] \\
        [--llamacpp-python /tmp/peers/llamacpp/bin/python --gguf-dir /tmp/peers/gguf] \\
        [--workloads W1,W2,W3,B32] [--variants bf16,int8,int4] [--repeats 3] [--json-out FILE]

Installs nothing: each peer runs in its own venv, through benchmarks/peers/*_runner.py, which
import nothing of dabba (see scripts/peers-bench.sh for how the venvs were made, and
benchmarks/peers/make_gguf.py for the GGUF files). Every run is a fresh process: dabba through
`dabba bench throughput|latency`, the peers through their runners, all on the same token ids
(dabba's random-prompt generator, same seed). The engines take turns within each repeat, in an
order that rotates between repeats, so drift on a noisy machine falls on all of them alike; the
report gives each figure's median over the repeats and the ratios the issue's targets name.

  W1  64 requests x 256 prompt tokens, 128 out             total tokens/s
  W2  1 request x 128 prompt tokens, 256 out (bf16, INT8, INT4 against bf16, Q8_0, Q4_0)
                                                            decode tokens/s and time to first token
  W3  32 requests sharing a 512-token prefix + 32 own, 64 out, prefix caching on
                                                            total tokens/s
  B32 32 requests x 256 prompt tokens, 64 out               total tokens/s
  serve (--serve)  `dabba serve` and `vllm serve` under the same Poisson arrivals, measured by
                   `dabba bench serve`: TTFT and TPOT p50/p99, goodput against --slo-*
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dabba.benchmark.offline import OfflineWorkload, make_prompts
from dabba.models.config import ArchConfig

PEERS_DIR = Path(__file__).resolve().parent / "peers"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
# vLLM's CPU build refuses to start on this VM without an explicit KV space; 2 threads on 2 cores.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "HF_HUB_OFFLINE": "1"}


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # "throughput" | "latency"
    shape: OfflineWorkload
    metric: str  # the figure the ratios compare


WORKLOADS = {
    "W1": Workload("W1", "throughput", OfflineWorkload(64, 256, 128), "total_tok_s"),
    "W2": Workload("W2", "latency", OfflineWorkload(1, 128, 256), "decode_tok_s"),
    "W3": Workload("W3", "throughput", OfflineWorkload(32, 32, 64, prefix_len=512), "total_tok_s"),
    "B32": Workload("B32", "throughput", OfflineWorkload(32, 256, 64), "total_tok_s"),
}

# (engine, variant) pairs whose ratio each target names: (workload, ours, theirs, at least)
TARGETS = [
    ("W1", ("dabba", "bf16"), ("vllm", "bf16"), 1.3),
    ("W2", ("dabba", "bf16"), ("llama.cpp", "bf16"), 1.1),
    ("W2", ("dabba", "int8"), ("llama.cpp", "q8_0"), 1.0),
    ("W2", ("dabba", "int4"), ("llama.cpp", "q4_0"), 1.0),
    ("W3", ("dabba", "bf16"), ("vllm", "bf16"), 1.0),
    ("B32", ("dabba", "bf16"), ("vllm", "bf16"), 1.3),  # issue 15's batch figure on Gemma-3 / Qwen2.5 shapes
]
PEER_VARIANT = {"bf16": "bf16", "int8": "q8_0", "int4": "q4_0"}  # llama.cpp's counterpart of each dabba W2 variant
DABBA_QUANT = {"bf16": None, "int8": "int8", "int4": "int4"}


def run_json(cmd: list[str], env: dict[str, str] | None = None, json_file: Path | None = None,
             timeout: float = 1800) -> dict[str, Any]:
    """Run one benchmark process; its result is ``json_file``, or else its last stdout line."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not (lines or json_file):
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(json_file.read_text()) if json_file else json.loads(lines[-1])


def run_dabba(model: str, w: Workload, variant: str, directory: str) -> dict[str, Any]:
    s = w.shape
    out = Path(directory) / "dabba.json"
    cmd = [sys.executable, "-m", "dabba.entrypoints.cli", "bench", w.kind, model, "--input-len", str(s.input_len),
           "--output-len", str(s.output_len), "--dataset-seed", str(s.seed), "--prefix-len", str(s.prefix_len),
           "--dtype", "bfloat16", "--json-out", str(out)]
    if w.kind == "throughput":
        cmd += ["--num-prompts", str(s.num_prompts)]
    else:
        cmd += ["--batch-size", str(s.num_prompts), "--num-iters-warmup", "1", "--num-iters", "3"]
    if DABBA_QUANT[variant]:
        cmd += ["--quantization", DABBA_QUANT[variant]]
    r = run_json(cmd, json_file=out)
    if w.kind == "throughput":
        return {"total_tok_s": r["total_tokens_per_s"], "output_tok_s": r["output_tokens_per_s"],
                "elapsed_s": r["elapsed_s"]}
    return {"decode_tok_s": r["decode_tokens_per_s"], "ttft_s": r["ttft_s"]["p50"], "e2e_s": r["latency_s"]["p50"]}


def write_spec(w: Workload, prompts: list[list[int]], prefix_caching: bool, directory: str,
               extra_bufts: bool = True) -> str:
    """``extra_bufts``: llama.cpp's repacked weight kernels (peers/llamacpp_runner.py)."""
    spec = {"kind": w.kind, "prompts": prompts, "output_len": w.shape.output_len, "prefix_caching": prefix_caching,
            "shared_prefix_len": w.shape.prefix_len, "max_model_len": 2048, "threads": 2, "warmup": True,
            "num_iters": 3, "extra_bufts": extra_bufts}
    path = Path(directory) / f"{w.name}.json"
    path.write_text(json.dumps(spec))
    return str(path)


def run_vllm(python: str, model: str, spec: str) -> dict[str, Any]:
    env = dict(VLLM_ENV)
    if Path(TCMALLOC).is_file():
        env["LD_PRELOAD"] = TCMALLOC
    return run_json([python, str(PEERS_DIR / "vllm_runner.py"), "--model", model, "--spec", spec], env)


def run_llamacpp(python: str, gguf_dir: str, variant: str, spec: str) -> dict[str, Any]:
    gguf = Path(gguf_dir) / f"model-{variant}.gguf"
    if not gguf.is_file():
        raise RuntimeError(f"{gguf} is missing: make it with benchmarks/peers/make_gguf.py")
    return run_json([python, str(PEERS_DIR / "llamacpp_runner.py"), "--gguf", str(gguf), "--spec", spec])


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


def run_online(engine: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    """Start one server, drive it with `dabba bench serve`'s client, stop it."""
    from dabba.benchmark.serve import ServeBenchConfig, run_serve_benchmark

    env: dict[str, str] = {}
    if engine == "dabba":
        cmd = [sys.executable, "-m", "dabba.entrypoints.cli", "serve", args.model, "--port", str(port),
               "--dtype", "bfloat16", "--max-model-len", "2048"]
    else:
        # the module, not the `vllm` script: the CPU build is the distribution vllm-cpu, and the
        # script looks up the version of a distribution named vllm
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--port",
               str(port), "--dtype", "bfloat16", "--max-model-len", "2048", "--seed", "0"]
        env = dict(VLLM_ENV, **({"LD_PRELOAD": TCMALLOC} if Path(TCMALLOC).is_file() else {}))
    base_url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env})
    try:
        wait_until_serving(base_url, proc)
        cfg = ServeBenchConfig(base_url=base_url, num_prompts=args.serve_prompts, input_len=args.serve_input_len,
                               output_len=args.serve_output_len, tokenizer=args.model,
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


def compare_online(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {}
    engines = ["dabba", "vllm"]
    for repeat in range(args.repeats):
        for engine in engines[repeat % 2:] + engines[:repeat % 2]:
            r = run_online(engine, args, 8100 + 2 * repeat + (engine == "vllm"))
            runs.setdefault(engine, []).append(r)
            print(f"serve repeat {repeat + 1}: {engine}: {json.dumps(r)}", file=sys.stderr, flush=True)
    medians = {e: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for e, rs in runs.items()}
    ours, theirs = medians["dabba"], medians["vllm"]
    checks = [{"metric": m, "dabba": ours[m], "vllm": theirs[m], "met": ours[m] <= theirs[m]}
              for m in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")]
    checks.append({"metric": "goodput", "dabba": ours["goodput"], "vllm": theirs["goodput"],
                   "met": ours["goodput"] > theirs["goodput"]})
    return {"request_rate": args.request_rate, "num_prompts": args.serve_prompts, "input_len": args.serve_input_len,
            "output_len": args.serve_output_len, "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
            "medians": medians, "checks": checks, "runs": runs}


def engines_for(w: Workload, args: argparse.Namespace) -> list[tuple[str, str]]:
    variants = args.variants if w.name == "W2" else ["bf16"]
    ours = [("dabba", v) for v in variants]
    peers = []
    if args.vllm_python:
        peers.append(("vllm", "bf16"))
    if args.llamacpp_python:
        peers += [("llama.cpp", PEER_VARIANT[v]) for v in variants]
    return ours + peers


def compare(args: argparse.Namespace) -> dict[str, Any]:
    vocab = ArchConfig.from_hf(args.model).vocab_size
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads:
            w = WORKLOADS[name]
            spec = write_spec(w, make_prompts(w.shape, vocab), prefix_caching=True, directory=tmp,
                              extra_bufts=not args.llamacpp_no_extra_bufts)
            engines = engines_for(w, args)
            runs = results.setdefault(name, {})
            for repeat in range(args.repeats):
                order = engines[repeat % len(engines):] + engines[:repeat % len(engines)]
                for engine, variant in order:
                    if engine == "dabba":
                        r = run_dabba(args.model, w, variant, tmp)
                    elif engine == "vllm":
                        r = run_vllm(args.vllm_python, args.model, spec)
                    else:
                        r = run_llamacpp(args.llamacpp_python, args.gguf_dir, variant, spec)
                    runs.setdefault(f"{engine}/{variant}", []).append(r)
                    print(f"{name} repeat {repeat + 1}: {engine} {variant}: {w.metric}={r[w.metric]:.1f}",
                          file=sys.stderr, flush=True)
    medians = {name: {key: {m: statistics.median(r[m] for r in rs) for m in rs[0] if isinstance(rs[0][m], float)}
                      for key, rs in runs.items()} for name, runs in results.items()}
    ratios = []
    for name, ours, theirs, target in TARGETS:
        got = medians.get(name, {})
        a, b = got.get("/".join(ours)), got.get("/".join(theirs))
        if a and b:
            metric = WORKLOADS[name].metric
            ratios.append({"workload": name, "dabba": ours[1], "peer": "/".join(theirs), "metric": metric,
                           "ratio": a[metric] / b[metric], "target": target, "met": a[metric] / b[metric] >= target})
    w2 = medians.get("W2", {})
    if "dabba/bf16" in w2 and "vllm/bf16" in w2:
        ratios.append({"workload": "W2", "dabba": "bf16", "peer": "vllm/bf16", "metric": "ttft_s (theirs / ours)",
                       "ratio": w2["vllm/bf16"]["ttft_s"] / w2["dabba/bf16"]["ttft_s"], "target": 1.0,
                       "met": w2["dabba/bf16"]["ttft_s"] <= w2["vllm/bf16"]["ttft_s"]})
    return {"model": args.model, "repeats": args.repeats, "llamacpp_extra_bufts": not args.llamacpp_no_extra_bufts,
            "workloads": {n: asdict(WORKLOADS[n].shape) for n in args.workloads}, "medians": medians,
            "ratios": ratios, "runs": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face checkpoint directory (bf16)")
    parser.add_argument("--vllm-python", default=None, help="the python of a venv with vllm-cpu")
    parser.add_argument("--llamacpp-python", default=None, help="the python of a venv with llama-cpp-python")
    parser.add_argument("--gguf-dir", default=None, help="model-{bf16,q8_0,q4_0}.gguf of --model (make_gguf.py)")
    parser.add_argument("--llamacpp-no-extra-bufts", action="store_true",
                        help="llama.cpp without its repacked weight kernels, where they crash (the report says so)")
    parser.add_argument("--workloads", default="W1,W2,W3", help="comma-separated subset of W1,W2,W3,B32")
    parser.add_argument("--variants", default="bf16,int8,int4",
                        help="W2's weight variants: dabba bf16,int8,int4 against llama.cpp bf16,q8_0,q4_0")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per engine and workload (default 3)")
    parser.add_argument("--serve", action="store_true", help="also compare online serving with vllm serve")
    parser.add_argument("--request-rate", type=float, default=4.0, help="--serve: Poisson requests/s (default 4)")
    parser.add_argument("--serve-prompts", type=int, default=64, help="--serve: requests (default 64)")
    parser.add_argument("--serve-input-len", type=int, default=128)
    parser.add_argument("--serve-output-len", type=int, default=128)
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0, help="--serve: goodput SLO (default 500)")
    parser.add_argument("--slo-tpot-ms", type=float, default=50.0, help="--serve: goodput SLO (default 50)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants or any(v not in PEER_VARIANT for v in args.variants):
        parser.error(f"--variants: a comma list of {', '.join(PEER_VARIANT)}")
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {sorted(WORKLOADS)}")
    if args.llamacpp_python and not args.gguf_dir:
        parser.error("--llamacpp-python needs --gguf-dir")
    if args.serve and not args.vllm_python:
        parser.error("--serve needs --vllm-python")
    result = compare(args)
    if args.serve:
        result["serve"] = compare_online(args)
        for c in result["serve"]["checks"]:
            print(f"serve {c['metric']}: dabba {c['dabba']:.1f}, vllm {c['vllm']:.1f} ({'met' if c['met'] else 'NOT met'})",
                  file=sys.stderr)
    text = json.dumps(result, indent=2)
    if args.json_out:
        Path(args.json_out).write_text(text)
    summary = {k: result[k] for k in ("model", "repeats", "llamacpp_extra_bufts", "medians", "ratios")}
    if args.serve:
        summary["serve"] = {k: v for k, v in result["serve"].items() if k != "runs"}
    print(json.dumps(summary, indent=2))
    for r in result["ratios"]:
        print(f"{r['workload']}: dabba {r['dabba']} / {r['peer']} {r['metric']}: {r['ratio']:.2f}x "
              f"(target {r['target']}x: {'met' if r['met'] else 'NOT met'})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
