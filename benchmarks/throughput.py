"""Offline throughput: N requests of random prompt ids through dabba's LLM.generate and through
transformers' generate with static batches, side by side in one run (each in its own process,
so peak RSS is per engine). Prints JSON.

    python -m benchmarks.throughput --model DIR [--num-prompts 64 --input-len 256 --output-len 128]
    python -m benchmarks.throughput --make-smollm-shaped /tmp/smollm   # writes the checkpoint first
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import threading
import time
from typing import Any

from dabba.config_fields import parse_bytes


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (num_prompts, input_len), generator=g).tolist()


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_mib() -> dict[str, float]:
    """This process's memory now (Linux): RSS and PSS split into anonymous and file-backed pages
    (file pages are what a mapped checkpoint adds), and the kernel's RSS high-water (VmHWM)."""
    fields = {"Rss": "rss", "Pss": "pss", "Pss_Anon": "pss_anon", "Pss_File": "pss_file"}
    out: dict[str, float] = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in fields:
                out[fields[key]] = int(value.split()[0]) / 1024
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                out["hwm_rss"] = int(line.split()[1]) / 1024
    return out


class PeakMemory:
    """High-water of RSS (the kernel's VmHWM, exact) and of PSS (sampled every ``interval`` s by a
    thread; torch ops release the GIL, so it samples through the load) over a ``with`` block."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.peak: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _record(self) -> None:
        for key, value in memory_mib().items():
            self.peak[key] = max(self.peak.get(key, 0.0), value)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._record()

    def __enter__(self) -> "PeakMemory":
        self._record()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._record()


def run_dabba(args: dict[str, Any], prompts: list[list[int]]) -> dict[str, Any]:
    from dabba import LLM
    from dabba.tools.bench.offline import warm_and_time

    engine_kwargs = {"dtype": args["dtype"], "max_num_batched_tokens": args["max_num_batched_tokens"]}
    if args["max_num_seqs"]:
        engine_kwargs["max_num_seqs"] = args["max_num_seqs"]
    if args["kv_cache_memory"]:
        engine_kwargs["kv_cache_memory"] = parse_bytes(args["kv_cache_memory"])
    llm = LLM(args["model"], **engine_kwargs)
    elapsed, outs = warm_and_time(llm, prompts, args["output_len"])
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"elapsed_s": elapsed, "num_output_tokens": num_out, "peak_rss_mib": peak_rss_mib(),
            "num_preemptions": llm.llm_engine.engine_core.scheduler.num_preemptions}


def run_transformers(args: dict[str, Any], prompts: list[list[int]]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=getattr(torch, args["dtype"])).eval()
    bs = args["hf_batch_size"]
    kw = dict(max_new_tokens=args["output_len"], min_new_tokens=args["output_len"], do_sample=False, eos_token_id=None)
    with torch.inference_mode():
        warm = torch.tensor([p[::-1] for p in prompts[:bs]])  # the workload's own shapes
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        num_out = 0
        for i in range(0, len(prompts), bs):
            batch = torch.tensor(prompts[i:i + bs])  # equal lengths: no padding needed
            out = model.generate(batch, attention_mask=torch.ones_like(batch), **kw)
            num_out += (out.shape[1] - batch.shape[1]) * batch.shape[0]
        elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "num_output_tokens": num_out, "peak_rss_mib": peak_rss_mib(), "batch_size": bs}


def _child(module: str, fn_name: str, args: dict[str, Any], prompts: list[list[int]], queue: mp.Queue) -> None:
    import importlib

    queue.put(getattr(importlib.import_module(module), fn_name)(args, prompts))


def run_isolated(fn_name: str, args: dict[str, Any], prompts: list[list[int]], module: str | None = None) -> dict[str, Any]:
    """Run ``module.fn_name(args, prompts)`` in a fresh process (its own peak RSS); the caller's
    module by default."""
    import inspect

    module = module or inspect.getmodule(inspect.stack()[1].frame).__spec__.name
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(module, fn_name, args, prompts, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def summarize(result: dict[str, Any], num_prompts: int, input_len: int) -> dict[str, Any]:
    t = result["elapsed_s"]
    total = num_prompts * input_len + result["num_output_tokens"]
    return {**result, "requests_per_s": num_prompts / t, "output_tokens_per_s": result["num_output_tokens"] / t,
            "total_tokens_per_s": total / t}


def make_smollm_shaped(out_dir: str, **tokenizer: Any) -> str:
    """``tokenizer``: make_checkpoint's tokenizer_vocab_size / tokenizer_corpus (default: a small one)."""
    from tools.tiny_checkpoint import make_checkpoint

    make_checkpoint(out_dir, "LlamaForCausalLM", dtype="bfloat16", vocab_size=49152, hidden_size=576,
                    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=100000.0,
                    **tokenizer)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="Hugging Face checkpoint directory")
    parser.add_argument("--make-smollm-shaped", metavar="DIR", help="write a SmolLM2-135M-shaped random bf16 checkpoint to DIR and use it")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=0, help="0: dabba's default")
    parser.add_argument("--kv-cache-memory", default=None, help="dabba's KV budget, e.g. 1GiB (default: the engine's)")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    if args.make_smollm_shaped:
        args.model = make_smollm_shaped(args.make_smollm_shaped)
    if not args.model:
        parser.error("--model or --make-smollm-shaped is required")

    import json as _json
    from pathlib import Path

    vocab_size = _json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(args.num_prompts, args.input_len, vocab_size, args.seed)
    opts = vars(args)
    report: dict[str, Any] = {"workload": {k: opts[k] for k in ("model", "num_prompts", "input_len", "output_len", "dtype", "seed")}}
    report["dabba"] = summarize(run_isolated("run_dabba", opts, prompts), args.num_prompts, args.input_len)
    if not args.skip_transformers:
        report["transformers"] = summarize(run_isolated("run_transformers", opts, prompts), args.num_prompts, args.input_len)
        report["ratio_total_tokens_per_s"] = report["dabba"]["total_tokens_per_s"] / report["transformers"]["total_tokens_per_s"]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
