"""One workload on vLLM (its CPU build), run with vLLM's own Python; prints one line of JSON.

    python benchmarks/peers/vllm_runner.py --model DIR --spec SPEC.json

SPEC.json is what benchmarks/compare_peers.py writes: {"kind": "throughput" | "latency",
"prompts": [[ids], ...], "output_len", "prefix_caching", "max_model_len", "warmup", "num_iters"}, and
optionally "kv_cache_bytes": the KV budget, as LLM(kv_cache_memory_bytes=...) (where the environment
sets no VLLM_CPU_KVCACHE_SPACE, which would override it); the result's kv_tokens is what the KV
cache it made holds. Greedy, EOS
ignored, token-id prompts; measured as `vllm bench throughput|latency` measure: throughput is all
prompts in one generate() call; latency is the median of num_iters end-to-end runs of one batch,
TTFT the median of as many max_tokens=1 runs, and the decode rate the tokens between them over
the time between them. Imports
nothing of dabba: this file runs in the peer's venv.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    spec = json.load(open(args.spec))

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kv = {"kv_cache_memory_bytes": int(spec["kv_cache_bytes"])} if spec.get("kv_cache_bytes") else {}
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=spec["max_model_len"], seed=0,
              enable_prefix_caching=spec["prefix_caching"], max_num_seqs=max(len(spec["prompts"]), 1), **kv)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    out_len = spec["output_len"]

    def run(batch: list, max_tokens: int) -> tuple[float, int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)

    if spec["warmup"]:  # reversed ids: the same shapes, no prefix-cache hits for the timed run
        run([TokensPrompt(prompt_token_ids=p["prompt_token_ids"][::-1]) for p in prompts[:16]], 4)
    num_prompt_tokens = sum(len(p) for p in spec["prompts"])
    if spec["kind"] == "throughput":
        elapsed, num_out = run(prompts, out_len)
        result = {"elapsed_s": elapsed, "num_prompt_tokens": num_prompt_tokens, "num_output_tokens": num_out,
                  "total_tok_s": (num_prompt_tokens + num_out) / elapsed, "output_tok_s": num_out / elapsed}
    else:  # as dabba bench latency: medians of num_iters end-to-end and first-token runs
        def timed(max_tokens: int) -> float:
            if spec["prefix_caching"]:
                llm.reset_prefix_cache()  # every iteration prefills the whole prompt
            return run(prompts, max_tokens)[0]

        timed(out_len)
        e2e = statistics.median(timed(out_len) for _ in range(spec["num_iters"]))
        ttft = statistics.median(timed(1) for _ in range(spec["num_iters"]))
        result = {"ttft_s": ttft, "e2e_s": e2e, "num_output_tokens": len(prompts) * out_len,
                  "decode_tok_s": len(prompts) * (out_len - 1) / (e2e - ttft)}
    cache = llm.llm_engine.vllm_config.cache_config  # the engine core's figures, as its client records them
    result["kv_tokens"] = (cache.num_gpu_blocks or 0) * cache.block_size
    print(json.dumps({"engine": "vllm", **result}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
