"""The measurements behind small choices in dabba's code, each against the alternative it was
chosen over, side by side in one process (the engine-thread one in two fresh processes). Prints
JSON, one line per choice. The code's comments name the choice; the figures live here.

    python -m benchmarks.design_choices [--repeats 20] [--skip engine_thread]

- sampling_draw (worker/random_draws.race): one draw per row of 32 x 49152 probabilities as
  argmax(p / -log U) with U from uniform_, against the same with exponential_.
- argmax_rows (worker/sampler.argmax_rows' reference): max(dim).indices against argmax over
  32 x 262144 float32 logits.
- decode_attention (attention/torch_ref.py): one query row per sequence, the sequences padded into
  one masked batch, attended with two batched matmuls and a float32 softmax, against SDPA in bf16
  with the same mask (8 sequences of up to 1024 keys, 32 heads of 64).
- engine_thread (engine/async_engine.py): a decode step of 8 rows of the demo model with the
  engine loop on the process's main thread, against on a thread of its own (each in a fresh
  process: the OpenMP thread team is made by the first thread that runs a parallel region).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def sampling_draw(repeats: int) -> dict:
    probs = torch.rand(32, 49152).softmax(dim=-1)

    def uniform_log() -> torch.Tensor:
        return (probs / torch.empty_like(probs).uniform_().log_().neg_()).max(dim=-1).indices

    def exponential() -> torch.Tensor:
        return (probs / torch.empty_like(probs).exponential_()).max(dim=-1).indices

    return {"choice": "sampling_draw", "chosen_ms": best_ms(uniform_log, repeats),
            "alternative_ms": best_ms(exponential, repeats), "shape": [32, 49152]}


def argmax_rows(repeats: int) -> dict:
    logits = torch.randn(32, 262144)
    same = bool(torch.equal(logits.max(dim=-1).indices, logits.argmax(dim=-1)))
    return {"choice": "argmax_rows", "chosen_ms": best_ms(lambda: logits.max(dim=-1).indices, repeats),
            "alternative_ms": best_ms(lambda: logits.argmax(dim=-1), repeats), "shape": [32, 262144],
            "same_result": same}


def decode_attention(repeats: int) -> dict:
    """As the reference backend's decodes: sequences of different lengths gathered into one padded
    batch, the padding masked."""
    seqs, heads, keys, d = 8, 32, 1024, 64
    g = torch.Generator().manual_seed(0)
    q = torch.randn(seqs, heads, 1, d, dtype=torch.bfloat16, generator=g)
    k = torch.randn(seqs, heads, keys, d, dtype=torch.bfloat16, generator=g)
    v = torch.randn(seqs, heads, keys, d, dtype=torch.bfloat16, generator=g)
    seq_lens = torch.randint(keys // 4, keys + 1, (seqs,), generator=g)
    padding = torch.arange(keys)[None, :] >= seq_lens[:, None]  # True = masked
    masked = padding[:, None, None, :]
    scale = d ** -0.5

    def matmuls() -> torch.Tensor:
        scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
        scores.masked_fill_(masked, float("-inf"))
        return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~masked, scale=scale)

    close = bool(torch.allclose(matmuls().float(), sdpa().float(), atol=2e-2))
    return {"choice": "decode_attention", "chosen_ms": best_ms(matmuls, repeats),
            "alternative_ms": best_ms(sdpa, repeats), "shape": {"seqs": seqs, "heads": heads, "keys": keys, "d": d},
            "same_result": close}


STEP_SCRIPT = """
import json, logging, statistics, sys, threading, time
logging.getLogger("dabba").setLevel(logging.WARNING)
from dabba import LLM, SamplingParams
llm = LLM("{model}")
engine = llm.llm_engine
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
def run(out):
    for i in range(8):
        engine.add_request(f"r{{i}}", {{"prompt_token_ids": list(range(5, 69))}}, params)
    engine.step()  # the prompts
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter(); engine.step(); times.append(time.perf_counter() - start)
    out.append(statistics.median(times) * 1e3)
out = []
if sys.argv[1] == "main":
    run(out)
else:
    t = threading.Thread(target=run, args=(out,)); t.start(); t.join()
print(json.dumps(out[0]))
"""


def engine_thread(model: str) -> dict:
    def step_ms(where: str) -> float:
        run = subprocess.run([sys.executable, "-c", STEP_SCRIPT.format(model=model), where], capture_output=True,
                             text=True, check=True)
        return float(run.stdout.strip().splitlines()[-1])

    main, other = [], []
    for _ in range(2):  # alternated: a process's memory bandwidth is a draw on these VMs
        main.append(step_ms("main"))
        other.append(step_ms("thread"))
    return {"choice": "engine_thread", "chosen_ms": statistics.median(main), "alternative_ms": statistics.median(other),
            "rows": 8, "model": model}


def main() -> None:
    from dabba.config import DEMO_MODEL

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip", default="", help="comma-separated choices to leave out")
    parser.add_argument("--model", default=str(DEMO_MODEL), help="for engine_thread")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    runs = {"sampling_draw": lambda: sampling_draw(args.repeats), "argmax_rows": lambda: argmax_rows(args.repeats),
            "decode_attention": lambda: decode_attention(args.repeats), "engine_thread": lambda: engine_thread(args.model)}
    for name, run in runs.items():
        if name not in skip:
            result = run()
            result["ratio"] = result["alternative_ms"] / result["chosen_ms"]
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
