"""The native layer loop (csrc/decode_cpu.cpp) against the Python layers it stands in for: decode
tokens/s of each, in one process, alternating. Prints JSON.

    python -m benchmarks.layer_loop --model DIR [--batch-size 1] [--input-len 128] [--output-len 64]
        [--rounds 4] [--quantization int8|int4|w8a8]

Both engines load the same checkpoint in one process, and each round runs one generate on each in
turn: on these VMs a process's memory bandwidth is a draw (some read ~46 GB/s, some ~66), so two
processes' decode rates differ by more than the loop's gain; within one process both see the same.
A round's decode rate is its generated tokens after the first, over the time of the steps after
every prompt had its first token. Greedy, so the report also says whether both gave the same
tokens (the loop is bit-identical by design; tests/test_native_layer_loop.py holds it so).
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Any

from dabba import LLM, SamplingParams
from dabba.tools.bench.offline import OfflineWorkload, make_prompts

_ids = itertools.count()


def decode_rate(llm: LLM, prompts: list[dict], output_len: int) -> tuple[float, list[list[int]]]:
    """Steps the engine itself: the clock starts once every prompt is prefilled and has its first token,
    so the rate counts decode steps only (a subtraction of two generates' times went negative on a
    tiny model once the machine was busy)."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    ids = [f"layer-loop-{next(_ids)}" for _ in prompts]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    scheduler = engine.engine_core.scheduler
    while engine.get_stats().num_waiting_reqs or any(not r.output_token_ids for r in scheduler.running):
        engine.step()
    finished: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    elapsed = time.perf_counter() - start
    return len(prompts) * (output_len - 1) / elapsed, [finished[r] for r in ids]


def run(model: str, batch_size: int, input_len: int, output_len: int, rounds: int,
        quantization: str | None) -> dict[str, Any]:
    llms = {setting: LLM(model, native_layer_loop=setting, quantization=quantization, enable_prefix_caching=False,
                         max_num_seqs=max(batch_size, 1))
            for setting in ("on", "off")}
    vocab = llms["on"].llm_engine.model_info.vocab_size
    prompts = [{"prompt_token_ids": p} for p in make_prompts(OfflineWorkload(batch_size, input_len, output_len), vocab)]
    rates: dict[str, list[float]] = {s: [] for s in llms}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(rounds):
        for setting, llm in llms.items():
            rate, tokens[setting] = decode_rate(llm, prompts, output_len)
            rates[setting].append(rate)
    medians = {s: statistics.median(r) for s, r in rates.items()}
    return {"model": model, "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
            "quantization": quantization, "decode_tok_s": {"native": rates["on"], "python": rates["off"]},
            "median_native_over_python": medians["on"] / medians["off"], "same_tokens": tokens["on"] == tokens["off"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--quantization", choices=["int8", "int4", "w8a8"], default=None)
    args = parser.parse_args()
    if args.output_len < 2:
        parser.error("--output-len must be at least 2 (the decode rate is of the tokens after the first)")
    print(json.dumps(run(args.model, args.batch_size, args.input_len, args.output_len, args.rounds, args.quantization),
                     indent=1))


if __name__ == "__main__":
    main()
