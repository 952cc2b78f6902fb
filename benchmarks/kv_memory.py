"""How much of the KV cache holds real tokens: dabba's paged cache, step by step, against a
contiguous-reservation baseline (max_model_len slots reserved per request, as before paging)
computed on the same request trace in the same memory. Prints JSON; writes a PNG chart.

    python -m benchmarks.kv_memory [--model DIR] [--kv-cache-memory 8MiB] [--chart kv_memory.png]

Two workloads: mixed prompt and output lengths, and the same with a shared system prompt (prefix
caching stores it once). Waste = 1 - token slots holding a real token / slots allocated, over
all steps. The PagedAttention paper reports 20-38% of KV memory used by real tokens before paging
and about 96% with it.

    python -m benchmarks.kv_memory --decode-speed [--model DIR] [--seqs 32] [--context 1024]

What an 8-bit cache costs in decode time instead: bf16, int8 and fp8 caches on the native CPU
backend (and layer loop), and int8/fp8 on the reference backend (the Python layers), side by side.
Per configuration, one decode step's attention over the model's layers (its shape, random keys
and values, blocks shuffled: the backend's forward, write included) and the engine's decode step
(``seqs`` prompts of ``context`` tokens, then ``--engine-steps`` batched decodes, each timed);
configurations interleaved for ``--rounds`` rounds (the machine may be shared), medians and each
one's ratio to the bf16 native figure.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

from dabba.config import DEMO_MODEL
from dabba.config_fields import parse_bytes


@dataclass
class Trace:
    prompts: list[list[int]]
    output_lens: list[int]


def make_trace(num: int, vocab: int, max_model_len: int, shared_prefix: int, seed: int) -> Trace:
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    prompts, outs = [], []
    for _ in range(num):
        own = rng.randint(16, max_model_len // 2 - shared_prefix) if shared_prefix else rng.randint(16, max_model_len // 2)
        prompts.append(system + [rng.randrange(3, vocab) for _ in range(own)])
        outs.append(rng.randint(16, max_model_len - len(prompts[-1]) - 1))
    return Trace(prompts, outs)


def run_paged(model: str, trace: Trace, kv_cache_memory: int, max_model_len: int) -> dict[str, Any]:
    """The real engine, all requests queued at once; a stats snapshot after every step."""
    from dabba import LLM, SamplingParams

    llm = LLM(model, kv_cache_memory=kv_cache_memory, max_model_len=max_model_len, max_num_seqs=1024)
    engine = llm.llm_engine
    for i, (prompt, out) in enumerate(zip(trace.prompts, trace.output_lens)):
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        s = llm.get_stats()
        steps.append({"running": s.num_running_reqs, "slots_allocated": s.kv_slots_allocated,
                      "tokens_stored": s.kv_tokens_stored, "prefix_hit_tokens": s.prefix_cache_hit_tokens})
    s = llm.get_stats()
    total_slots = s.kv_blocks_total * engine.engine_core.cache_layout.block_size
    return {"total_slots": total_slots, "num_blocks": s.kv_blocks_total, "steps": steps,
            "prefix_cache_hit_rate": s.prefix_cache_hit_rate, "num_preemptions": s.num_preemptions}


def run_contiguous(trace: Trace, total_slots: int, max_model_len: int) -> dict[str, Any]:
    """Each admitted request reserves max_model_len slots until it finishes; FCFS; one step
    prefills a request or decodes one token, as in the engine's steady state."""
    capacity = total_slots // max_model_len
    queue = list(range(len(trace.prompts)))
    running: dict[int, int] = {}  # request -> tokens held
    steps = []
    while queue or running:
        while queue and len(running) < capacity:
            i = queue.pop(0)
            running[i] = len(trace.prompts[i])  # prefilled on admission
        for i in list(running):
            running[i] += 1
            if running[i] >= len(trace.prompts[i]) + trace.output_lens[i]:
                del running[i]
        held = sum(running.values())
        steps.append({"running": len(running), "slots_allocated": len(running) * max_model_len, "tokens_stored": held})
        if capacity == 0:
            raise ValueError("the KV-cache memory holds not even one max_model_len reservation")
    return {"capacity": capacity, "steps": steps}


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    allocated = sum(s["slots_allocated"] for s in steps)
    stored = sum(s["tokens_stored"] for s in steps)
    return {"steps": len(steps), "max_running": max(s["running"] for s in steps),
            "mean_running": sum(s["running"] for s in steps) / len(steps),
            "used_by_real_tokens_pct": 100 * stored / allocated, "waste_pct": 100 * (1 - stored / allocated)}


def chart(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 7), squeeze=False)
    for col, (name, r) in enumerate(results.items()):
        for label, steps in (("paged (dabba)", r["paged"]["steps"]), ("contiguous reservation", r["contiguous"]["steps"])):
            util = [100 * s["tokens_stored"] / s["slots_allocated"] if s["slots_allocated"] else None for s in steps]
            axes[0][col].plot(util, label=label)
            axes[1][col].plot([s["running"] for s in steps], label=label)
        axes[0][col].set_title(f"{name}: KV slots holding real tokens (%)")
        axes[0][col].set_ylim(0, 105)
        axes[1][col].set_title(f"{name}: running sequences")
        axes[1][col].set_xlabel("engine step")
        for ax in axes[:, col]:
            ax.legend()
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# (kv_cache_dtype, attention_backend): bf16 and 8-bit on the native kernels, 8-bit on the reference
KV_SPEED_CONFIGS = (("auto", "cpu"), ("int8", "cpu"), ("fp8", "cpu"), ("int8", "torch_ref"), ("fp8", "torch_ref"))


def decode_attention_layers(model: str, kv_cache_dtype: str, backend_name: str, seqs: int, context: int,
                            layers: int | None = None, seed: int = 0) -> Callable[[], None]:
    """One decode step's attention (write and attend) over ``layers`` of the model's layers (all by
    default), bf16 queries, each layer its own cache of random keys and values written through the
    backend, so that every layer reads cold memory as in a step."""
    import numpy as np
    import torch

    from dabba.attention.backend import CommonAttentionMetadata
    from dabba.attention.kv_quant import SCALE_DTYPE, make_kv_quant
    from dabba.attention.selector import get_attention_backend
    from dabba.arch.config import ArchConfig

    arch = ArchConfig.from_hf(model)
    kv_quant = make_kv_quant(kv_cache_dtype, torch.bfloat16)
    backend = get_attention_backend(backend_name, torch.device("cpu"), kv_quant)
    heads, kv_heads, head_dim, bs = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, 16
    blocks_per_seq = -(-context // bs)
    num_blocks = seqs * blocks_per_seq
    rng = np.random.default_rng(seed)
    table = rng.permutation(num_blocks).reshape(seqs, blocks_per_seq).astype(np.int64)
    pos = context - 1  # each sequence decodes its last position
    everything = SimpleNamespace(slot_mapping=torch.arange(num_blocks * bs))  # write_kv reads only the slots
    step = backend.build_metadata(CommonAttentionMetadata(
        np.arange(seqs + 1, dtype=np.int64), np.full(seqs, context, dtype=np.int64), table,
        torch.from_numpy(table[:, pos // bs] * bs + pos % bs), bs, torch.device("cpu")))
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(seqs, h, head_dim, generator=g).bfloat16() for h in (heads, kv_heads, kv_heads))
    caches = []
    for _ in range(layers or arch.num_hidden_layers):
        shape = backend.kv_cache_shape(num_blocks, bs, kv_heads, head_dim)
        cache = torch.zeros(shape, dtype=torch.bfloat16) if kv_quant is None else (
            torch.zeros(shape, dtype=kv_quant.storage_dtype), torch.zeros(shape[:-1], dtype=SCALE_DTYPE))
        context_kv = torch.randn(2, num_blocks * bs, kv_heads, head_dim, generator=g).bfloat16()
        backend.write_kv(*backend.split_cache(cache), context_kv[0], context_kv[1], everything)
        caches.append(cache)
    scale = head_dim ** -0.5
    return lambda: [backend.forward(q, k, v, cache, step, scale) for cache in caches]


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """Seconds of fn(): wall clock, and CPU time of this process (all its threads), which a shared
    machine's other load inflates less."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def engine_decode_steps(model: str, kv_cache_dtype: str, backend_name: str, seqs: int, context: int,
                        steps: int, seed: int = 0) -> list[tuple[float, float]]:
    """The engine's batched decode: ``seqs`` random prompts of ``context`` tokens prefilled, then
    timed() of each of ``steps`` steps in which every sequence decodes one token."""
    from dabba import LLM, SamplingParams

    llm = LLM(model, kv_cache_dtype=kv_cache_dtype, attention_backend=backend_name, max_num_seqs=seqs,
              max_model_len=context + steps + 8, enable_prefix_caching=False)
    engine = llm.llm_engine
    rng = random.Random(seed)
    for i in range(seqs):
        prompt = [rng.randrange(3, engine.model_info.vocab_size) for _ in range(context)]
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    started: set[str] = set()
    while len(started) < seqs:  # prefill (chunked or not) until every request has its first token
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    return [timed(engine.step) for _ in range(steps)]


def compare_decode_speed(model: str, seqs: int, context: int, rounds: int, repeats: int, engine_steps: int,
                         attention_layers: int | None) -> dict[str, Any]:
    """Medians over interleaved rounds (wall clock and process CPU time), and each configuration's
    ratio to bf16 on the native backend."""
    attention: dict[str, list[tuple[float, float]]] = {}
    engine: dict[str, list[tuple[float, float]]] = {}
    names = [f"{dtype if dtype != 'auto' else 'bf16'} {backend}" for dtype, backend in KV_SPEED_CONFIGS]
    for _ in range(rounds):
        for name, (dtype, backend) in zip(names, KV_SPEED_CONFIGS):
            run = decode_attention_layers(model, dtype, backend, seqs, context, attention_layers)
            run()  # warm: first calls allocate
            attention.setdefault(name, []).extend(timed(run) for _ in range(repeats))
            del run
            if engine_steps:
                engine.setdefault(name, []).extend(engine_decode_steps(model, dtype, backend, seqs, context,
                                                                       engine_steps))

    def table(times: dict[str, list[tuple[float, float]]]) -> dict[str, Any]:
        out = {}
        for name, t in times.items():
            wall, cpu = (statistics.median(x[i] for x in t) for i in (0, 1))
            base_wall, base_cpu = (statistics.median(x[i] for x in times[names[0]]) for i in (0, 1))
            out[name] = {"wall_ms": round(1e3 * wall, 2), "cpu_ms": round(1e3 * cpu, 2),
                         "wall_vs_bf16_native": round(wall / base_wall, 3), "cpu_vs_bf16_native": round(cpu / base_cpu, 3)}
        return out

    import torch

    result: dict[str, Any] = {"model": model, "seqs": seqs, "context": context, "rounds": rounds,
                              "threads": torch.get_num_threads(),
                              "attention_step": {"layers": attention_layers or "all", **table(attention)}}
    if engine_steps:
        result["engine_decode_step"] = {"steps_per_round": engine_steps, **table(engine)}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEMO_MODEL)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("8MiB"))
    p.add_argument("--shared-prefix", type=int, default=128, help="system-prompt tokens of the second workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chart", default="kv_memory.png", help="PNG path ('' for none)")
    p.add_argument("--decode-speed", action="store_true",
                   help="instead: decode time by KV-cache dtype and attention backend (see above)")
    p.add_argument("--seqs", type=int, default=32, help="--decode-speed: sequences decoding together")
    p.add_argument("--context", type=int, default=1024, help="--decode-speed: positions each attends")
    p.add_argument("--rounds", type=int, default=3, help="--decode-speed: interleaved rounds")
    p.add_argument("--repeats", type=int, default=5, help="--decode-speed: attention steps timed per round")
    p.add_argument("--engine-steps", type=int, default=16, help="--decode-speed: engine decode steps per round "
                   "(0: attention only)")
    p.add_argument("--attention-layers", type=int, default=None, help="--decode-speed: layers (default: all)")
    p.add_argument("--threads", type=int, default=None, help="--decode-speed: torch threads (default: torch's); "
                   "on a loaded machine 1 keeps each parallel region from waiting on a descheduled thread")
    args = p.parse_args()
    if args.decode_speed:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        print(json.dumps(compare_decode_speed(args.model, args.seqs, args.context, args.rounds, args.repeats,
                                              args.engine_steps, args.attention_layers), indent=2))
        return

    from pathlib import Path

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    results: dict[str, Any] = {}
    for name, prefix in (("mixed lengths", 0), ("shared system prompt", args.shared_prefix)):
        trace = make_trace(args.num_prompts, vocab, args.max_model_len, prefix, args.seed)
        paged = run_paged(args.model, trace, args.kv_cache_memory, args.max_model_len)
        contiguous = run_contiguous(trace, paged["total_slots"], args.max_model_len)
        results[name] = {"paged": paged, "contiguous": contiguous}
    report: dict[str, Any] = {"workload": {k: v for k, v in vars(args).items() if k != "chart"}}
    for name, r in results.items():
        report[name] = {"kv_slots": r["paged"]["total_slots"], "paged": summarize(r["paged"]["steps"]),
                        "contiguous": {**summarize(r["contiguous"]["steps"]), "capacity": r["contiguous"]["capacity"]},
                        "prefix_cache_hit_rate": r["paged"]["prefix_cache_hit_rate"],
                        "num_preemptions": r["paged"]["num_preemptions"]}
    if args.chart:
        chart(results, args.chart)
        report["chart"] = args.chart
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
