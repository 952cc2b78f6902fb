"""What a JSON-schema constraint costs: decode tokens/s of the same requests with and without it,
side by side in one process, at each batch size; and the first request's latency with its
schema compiled cold and cached. Prints JSON.

    python -m benchmarks.structured_outputs --make-smollm-shaped /tmp/smollm-so

The checkpoint is SmolLM2-135M-shaped with a tokenizer of the model's full 49152 tokens (trained
on the Python standard library's source): xgrammar's work per token grows with the vocabulary, so
a small tokenizer behind a large embedding would flatter it. The schema (records with integers,
bounded strings, an e-mail pattern, an enum and a boolean, at least 64 of them) cannot end before
the output length, so both runs decode exactly as many tokens.
"""
from __future__ import annotations

import argparse
import json
import random
import time
import uuid
from typing import Any

from benchmarks.throughput import make_smollm_shaped

SCHEMA = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 100000},
            "name": {"type": "string", "maxLength": 16},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
            "role": {"enum": ["admin", "user", "guest"]},
            "active": {"type": "boolean"},
        },
        "required": ["id", "name", "email", "role", "active"],
    },
}


def decode_rate(llm, prompts: list[list[int]], output_len: int, schema: dict | None) -> float:
    """Output tokens per second over the steps after the first (which prefills every prompt)."""
    from dabba import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                            structured_outputs={"json": schema, "disable_any_whitespace": True} if schema else None)
    for prompt in prompts:
        engine.add_request(f"r{uuid.uuid4().hex}", {"prompt_token_ids": prompt}, params)
    engine.step()
    num_tokens, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        _, stats = engine.step_with_stats()
        num_tokens += sum(r.num_new_tokens for r in stats.requests.values())
    return num_tokens / (time.perf_counter() - start)


def first_token_s(llm, prompt: list[int], schema: dict | None) -> float:
    from dabba import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=1, structured_outputs={"json": schema} if schema else None)
    start = time.perf_counter()
    engine.add_request(f"f{uuid.uuid4().hex}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint directory (its tokenizer should be the model's real one)")
    parser.add_argument("--make-smollm-shaped", metavar="DIR", help="write the checkpoint described above to DIR")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each kind; the best counts")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    if args.make_smollm_shaped:
        args.model = make_smollm_shaped(args.make_smollm_shaped, tokenizer_vocab_size=49152, tokenizer_corpus="stdlib")
    if not args.model:
        parser.error("--model or --make-smollm-shaped is required")

    from dabba import LLM

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.batch_sizes))
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size
    report: dict[str, Any] = {"benchmark": "structured_outputs", "model": args.model, "schema": SCHEMA,
                              "output_len": args.output_len, "input_len": args.input_len}
    prompt = [rng.randrange(3, vocab) for _ in range(args.input_len)]
    first_token_s(llm, prompt, None)  # warm
    first_schema, cold_schema = ({**SCHEMA, "description": uuid.uuid4().hex} for _ in range(2))  # keys no cache has seen
    report["first_request_s"] = {
        "plain": first_token_s(llm, prompt, None),
        # the process's first constraint also builds xgrammar's view of the vocabulary and starts a compiler process
        "schema_first_in_process": first_token_s(llm, prompt, first_schema),
        "schema_cold": first_token_s(llm, prompt, cold_schema),
        "schema_cached": first_token_s(llm, prompt, cold_schema)}
    for batch in args.batch_sizes:
        prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(batch)]
        decode_rate(llm, prompts, 8, SCHEMA)  # warm both paths on this batch's shapes
        best = {"plain": 0.0, "json_schema": 0.0}
        for _ in range(args.repeats):
            best["plain"] = max(best["plain"], decode_rate(llm, prompts, args.output_len, None))
            best["json_schema"] = max(best["json_schema"], decode_rate(llm, prompts, args.output_len, SCHEMA))
        report[f"batch_{batch}"] = {"decode_tokens_per_s": best,
                                    "slowdown": 1 - best["json_schema"] / best["plain"]}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
