"""What tensor parallelism costs on one host: W1 (64 prompts x 256 -> 128, total tokens/s) and W2
(1 x 128 -> 256, decode tokens/s) at tensor_parallel_size N, each rank a process on its own share
of the cores (one thread each on a 2-core machine), against one rank with all the cores, in
one process, alternating rounds. Prints JSON: each round's figures and the ratios of the medians.

    python -m benchmarks.tp_scaling --model DIR [--tp 2] [--rounds 3] [--workloads W1,W2] [--dtype bfloat16]

On a machine with as many cores as ranks, tp=N cannot beat tp=1: the same cores read the same
weights, and the ranks add the collectives (benchmarks/tp_comm.py; the native layer loop sums over
the ranks through shared memory). The ratio is what splitting a model costs where it must be split.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from dabba import LLM, SamplingParams
from dabba.tools.bench.offline import OfflineWorkload, make_prompts, warm_and_time

WORKLOADS = {"W1": OfflineWorkload(num_prompts=64, input_len=256, output_len=128),
             "W2": OfflineWorkload(num_prompts=1, input_len=128, output_len=256)}


def w2_decode_rate(llm: LLM, prompt: list[int], output_len: int) -> float:
    """Decode tokens/s of one request: the time after its first token."""
    engine = llm.llm_engine
    engine.add_request("w2", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    engine.step()  # the prefill, and the first token
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (output_len - 1) / (time.perf_counter() - start)


def measure(llm: LLM, workload: str) -> float:
    w = WORKLOADS[workload]
    prompts = make_prompts(w, llm.llm_engine.model_info.vocab_size)
    if workload == "W2":
        warm_and_time(llm, prompts, 8)
        return w2_decode_rate(llm, prompts[0], w.output_len)
    elapsed, outputs = warm_and_time(llm, prompts, w.output_len)
    return (sum(len(p) for p in prompts) + sum(len(o.outputs[0].token_ids) for o in outputs)) / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", default="W1,W2")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    engines = {1: LLM(args.model, dtype=args.dtype, max_model_len=512),
               args.tp: LLM(args.model, dtype=args.dtype, max_model_len=512, tensor_parallel_size=args.tp)}
    rounds: dict[str, dict[int, list[float]]] = {w: {tp: [] for tp in engines} for w in args.workloads.split(",")}
    for _ in range(args.rounds):
        for workload, by_tp in rounds.items():
            for tp, llm in engines.items():
                by_tp[tp].append(measure(llm, workload))
    for workload, by_tp in rounds.items():
        medians = {tp: statistics.median(v) for tp, v in by_tp.items()}
        print(json.dumps({"benchmark": "tp_scaling", "model": args.model, "workload": workload,
                          "unit": "decode tok/s" if workload == "W2" else "total tok/s",
                          "rounds": {f"tp{tp}": [round(x, 1) for x in v] for tp, v in by_tp.items()},
                          f"tp1_over_tp{args.tp}": round(medians[1] / medians[args.tp], 3)}))
    engines[args.tp].llm_engine.shutdown()


if __name__ == "__main__":
    main()
