"""Embeddings beside chat: ``--streams`` generation requests decode while embedding requests arrive
(Poisson, ``--embed-rate`` a second, ``--embed-len`` tokens each) on one engine (a decoder served
as a generator, which embeds too). The streams' time per output token (TPOT) against their own
figure with no embeddings, measured alternately (alone, mixed, alone, mixed, ...), and the
embeddings' rate and latency while the streams decode.

    .venv/bin/python -m benchmarks.embed_mixed --make-model /tmp/embed-shapes/qwen3-0.6b-chat
    .venv/bin/python -m benchmarks.embed_mixed --model /tmp/embed-shapes/qwen3-0.6b-chat \\
        [--streams 8 --input-len 128 --output-len 128 --embed-len 256 --embed-rate 1 --repeats 2]

--make-model writes a random generating checkpoint of Qwen3-Embedding-0.6B's shape (its layers
with an LM head tied to the embedding: a Qwen3-0.6B), which serves both kinds of request.

Prints one JSON object: each run's figures and the ratio of the median TPOTs (mixed / alone).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

FIRST_TOKEN_ID = 3  # random ids start past <unk>/<s>/</s>-style specials


@dataclass(frozen=True)
class MixedWorkload:
    streams: int = 8
    input_len: int = 128
    output_len: int = 128
    embed_len: int = 256
    embed_rate: float = 1.0  # embedding requests a second, arriving while the streams decode
    seed: int = 0


def _ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]


def run_once(engine: Any, w: MixedWorkload, mixed: bool, run: int) -> dict[str, Any]:
    """One run: the streams from prefill to their last token, embeddings arriving from the moment
    every stream has its first token until the last stream finishes (any still running then are
    aborted, not counted). Fresh random prompts each run: nothing is served from the prefix cache."""
    from dabba import PoolingParams, SamplingParams
    from dabba.outputs import PoolingRequestOutput

    vocab = engine.model_info.vocab_size
    rng = random.Random(f"{w.seed}-{run}")  # (an int seed's sign is dropped: -1 would repeat 1's prompts)
    greedy = SamplingParams(max_tokens=w.output_len, temperature=0.0, ignore_eos=True)
    token_times: dict[str, list[float]] = {}
    for i in range(w.streams):
        rid = f"r{run}-chat-{i}"
        engine.add_request(rid, {"prompt_token_ids": _ids(rng, w.input_len, vocab)}, greedy)
        token_times[rid] = []
    arrivals: dict[str, float] = {}
    done: dict[str, float] = {}
    next_arrival = None
    while any(len(t) < w.output_len for t in token_times.values()):
        now = time.perf_counter()
        if mixed and next_arrival is None and all(token_times.values()):
            next_arrival = now  # the decode phase begins: the first embedding arrives now
        while next_arrival is not None and next_arrival <= now:
            rid = f"r{run}-embed-{len(arrivals)}"
            engine.add_request(rid, {"prompt_token_ids": _ids(rng, w.embed_len, vocab)}, PoolingParams())
            arrivals[rid] = next_arrival
            next_arrival += rng.expovariate(w.embed_rate)
        outputs = engine.step()
        t = time.perf_counter()
        for out in outputs:
            if isinstance(out, PoolingRequestOutput):
                done[out.request_id] = t
            else:
                times = token_times[out.request_id]
                times.extend([t] * (len(out.outputs[0].token_ids) - len(times)))
    for rid in set(arrivals) - set(done):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    tpots = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in token_times.values()]
    decode_start = max(ts[0] for ts in token_times.values())
    decode_s = max(ts[-1] for ts in token_times.values()) - decode_start
    latencies = sorted(done[r] - arrivals[r] for r in done)
    return {"mixed": mixed, "tpot_ms": 1000 * statistics.mean(tpots), "decode_s": decode_s,
            "embeddings_arrived": len(arrivals), "embeddings_done": len(done),
            "embeddings_per_s": len(done) / decode_s if mixed else None,
            "embed_latency_p50_s": statistics.median(latencies) if latencies else None,
            "embed_latency_max_s": latencies[-1] if latencies else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--make-model", metavar="OUT", help="write the Qwen3-0.6B-shaped checkpoint to OUT and exit")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--pooling-decode-slowdown", type=float, default=None,
                        help="the engine option (default: the engine's; 0: embeddings take the step budget)")
    for f in MixedWorkload.__dataclass_fields__.values():
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = parser.parse_args(argv)
    w = MixedWorkload(**{k: getattr(args, k) for k in MixedWorkload.__dataclass_fields__})
    if args.make_model:
        from benchmarks.embed_peers import SHAPES
        from tools.tiny_checkpoint import make_checkpoint

        make_checkpoint(args.make_model, "Qwen3ForCausalLM", dtype="bfloat16", tokenizer_vocab_size=4096,
                        **SHAPES["qwen3-embedding-0.6b"]["config"])
        return
    if not args.model:
        parser.error("--model (or --make-model) is required")

    import torch

    from dabba import LLM

    options: dict[str, Any] = dict(runner="generate", dtype=args.dtype, max_num_seqs=max(64, 2 * w.streams))
    if args.pooling_decode_slowdown is not None:
        options["pooling_decode_slowdown"] = args.pooling_decode_slowdown
    llm = LLM(args.model, **options)
    engine = llm.llm_engine
    warm = run_once(engine, MixedWorkload(w.streams, w.input_len, 4, w.embed_len, 1000.0, w.seed), True, -1)
    assert warm["embeddings_arrived"] > 0
    runs = [run_once(engine, w, mixed, 2 * r + mixed) for r in range(args.repeats) for mixed in (False, True)]
    alone = statistics.median(r["tpot_ms"] for r in runs if not r["mixed"])
    mixed = statistics.median(r["tpot_ms"] for r in runs if r["mixed"])
    print(json.dumps({"benchmark": "embed_mixed", "model": args.model, "engine": options,
                      "threads": torch.get_num_threads(), **asdict(w), "runs": runs,
                      "tpot_alone_ms": alone, "tpot_mixed_ms": mixed, "tpot_ratio": mixed / alone}, indent=1))


if __name__ == "__main__":
    main()
