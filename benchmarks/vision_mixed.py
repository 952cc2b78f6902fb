"""Images beside chat: ``--streams`` text requests decode while image requests arrive (one
``--image-size`` image and about 64 tokens of text each, every ``--image-every`` seconds, each a new
image) on one engine of a vision-language checkpoint (benchmarks/vision_ttft.py --make-model
writes a Gemma-3-4B-shaped one). The streams' time per output token (TPOT) and their longest stall
between two tokens, against their own figures with no images, measured alternately.

    .venv/bin/python -m benchmarks.vision_mixed --model /tmp/vl/gemma3-4b \\
        [--streams 8 --input-len 128 --output-len 32 --image-every 10 --repeats 1 --image-decode-slowdown 1.5]

Prints one JSON object: each run's figures and the ratio of the median TPOTs (mixed / alone).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from benchmarks.vision_ttft import workload


def run_once(engine: Any, model: str, args: argparse.Namespace, mixed: bool, run: int) -> dict[str, Any]:
    """One run: the streams from prefill to their last token; with ``mixed``, image requests
    arriving from the moment every stream has its first token until the last stream finishes
    (those still running then are aborted, not counted)."""
    from dabba import SamplingParams

    rng = random.Random(run)
    greedy = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    token_times: dict[str, list[float]] = {}
    for i in range(args.streams):
        rid = f"r{run}-chat-{i}"
        engine.add_request(rid, {"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(args.input_len)]}, greedy)
        token_times[rid] = []
    arrivals: dict[str, float] = {}
    firsts: dict[str, float] = {}
    next_arrival = None
    while any(len(t) < args.output_len for t in token_times.values()):
        now = time.perf_counter()
        if mixed and next_arrival is None and all(token_times.values()):
            next_arrival = now
        while next_arrival is not None and next_arrival <= now:
            rid = f"r{run}-image-{len(arrivals)}"
            prompt, image = workload(model, 1000 * (run + 1) + len(arrivals), 64)  # a new image each
            engine.add_request(rid, {"prompt": prompt, "multi_modal_data": {"image": image}},
                               SamplingParams(max_tokens=1, temperature=0.0))
            arrivals[rid] = next_arrival
            next_arrival += args.image_every
        outputs = engine.step()
        t = time.perf_counter()
        for out in outputs:
            if out.request_id in token_times:
                times = token_times[out.request_id]
                times.extend([t] * (len(out.outputs[0].token_ids) - len(times)))
            elif out.outputs[0].token_ids:
                firsts.setdefault(out.request_id, t)
    for rid in set(arrivals) - set(firsts):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    tpots = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in token_times.values()]
    stalls = [max(b - a for a, b in zip(ts, ts[1:])) for ts in token_times.values()]
    ttfts = sorted(firsts[r] - arrivals[r] for r in firsts)
    return {"mixed": mixed, "tpot_ms": round(1000 * statistics.mean(tpots), 1),
            "longest_stall_s": round(max(stalls), 2), "images_arrived": len(arrivals), "images_done": len(firsts),
            "image_ttft_p50_s": round(statistics.median(ttfts), 2) if ttfts else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--image-every", type=float, default=10.0, help="seconds between image requests")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--image-decode-slowdown", type=float, default=None,
                        help="the engine's (default: its own default; 0: images encoded whole, unrationed)")
    args = parser.parse_args(argv)

    import torch

    from dabba import LLM

    ration = {} if args.image_decode_slowdown is None else {"image_decode_slowdown": args.image_decode_slowdown}
    engine = LLM(args.model, max_num_batched_tokens=2048, **ration).llm_engine
    run_once(engine, args.model, argparse.Namespace(**{**vars(args), "output_len": 2}), True, -1)  # warm up
    runs = [run_once(engine, args.model, args, mixed, 2 * r + mixed) for r in range(args.repeats)
            for mixed in (False, True)]
    alone = statistics.median(r["tpot_ms"] for r in runs if not r["mixed"])
    mixed = statistics.median(r["tpot_ms"] for r in runs if r["mixed"])
    print(json.dumps({"benchmark": "vision_mixed", "model": args.model, "threads": torch.get_num_threads(),
                      **{k: v for k, v in vars(args).items() if k != "model"}, "runs": runs,
                      "tpot_alone_ms": alone, "tpot_mixed_ms": mixed, "tpot_ratio": round(mixed / alone, 3)}))


if __name__ == "__main__":
    main()
