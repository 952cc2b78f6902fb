"""`dabba bench throughput` and `dabba bench latency`: the engine in this process, no server, as
`vllm bench throughput|latency` measure it. Random prompt ids with a fixed seed (or consecutive
windows of a text file), greedy, EOS ignored so every request makes exactly its output length.
The model loads and warms up on the workload's shapes before the clock starts. Prints JSON."""
from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


FIRST_TOKEN_ID = 3  # random prompt ids start past <unk>/<s>/</s>-style specials


@dataclass(frozen=True)
class OfflineWorkload:
    num_prompts: int = 64
    input_len: int = 256
    output_len: int = 128
    dataset: str = "random"  # or "file"
    dataset_path: str | None = None
    seed: int = 0
    prefix_len: int = 0  # random dataset: a prefix every prompt shares, before its own input_len ids
    num_prefixes: int = 1  # random dataset: prompt i takes prefix i % num_prefixes (vllm bench's prefix_repetition)


def make_prompts(w: OfflineWorkload, vocab_size: int, tokenizer=None) -> list[list[int]]:
    """Token-id prompts: random ids in [FIRST_TOKEN_ID, vocab), ``prefix_len`` shared ones (one of
    ``num_prefixes`` prefixes, in turn) then ``input_len`` of each prompt's own (vllm bench's
    --random-prefix-len); or consecutive windows of ``input_len`` tokens of the file."""
    if w.num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {w.num_prefixes}")
    if w.dataset == "random":
        rng = random.Random(w.seed)
        prefixes = [[rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(w.prefix_len)]
                    for _ in range(w.num_prefixes)]
        return [prefixes[i % w.num_prefixes] + [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(w.input_len)]
                for i in range(w.num_prompts)]
    if w.prefix_len:
        raise ValueError("prefix_len applies to the random dataset only")
    if w.dataset != "file" or not w.dataset_path:
        raise ValueError('dataset must be "random", or "file" with dataset_path')
    ids = tokenizer.encode(Path(w.dataset_path).read_text(), add_special_tokens=False)
    if len(ids) < w.input_len:
        raise ValueError(f"dataset_path: {len(ids)} tokens, fewer than input_len={w.input_len}")
    starts = [(i * w.input_len) % (len(ids) - w.input_len + 1) for i in range(w.num_prompts)]
    return [ids[s:s + w.input_len] for s in starts]


def _percentiles(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"mean": statistics.fmean(values), "p10": q[9], "p50": q[49], "p90": q[89], "p99": q[98]}


def warm_and_time(llm, prompts: list[list[int]], output_len: int, loras: list | None = None) -> tuple[float, list]:
    """Warm up on the shapes of a prefill and of batched decodes (reversed ids, so that the timed
    run finds nothing of its own in the prefix cache), then time one generate() of all prompts,
    greedy with EOS ignored (``loras``: each prompt's LoRARequest or None). Returns (seconds, outputs)."""
    from dabba import SamplingParams

    llm.generate([{"prompt_token_ids": p[::-1]} for p in prompts[:4]], SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False, lora_request=loras[:4] if loras else None)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - start, outputs


def bench_throughput(model: str, w: OfflineWorkload, **engine_kwargs: Any) -> dict[str, Any]:
    from dabba import LLM

    llm = LLM(model, **engine_kwargs)
    prompts = make_prompts(w, llm.llm_engine.model_info.vocab_size, llm.get_tokenizer())
    elapsed, outputs = warm_and_time(llm, prompts, w.output_len)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(p) for p in prompts)
    return {"benchmark": "throughput", "model": model, "workload": asdict(w), "engine": engine_kwargs,
            "elapsed_s": elapsed, "requests_per_s": len(prompts) / elapsed,
            "total_tokens_per_s": (in_tokens + out_tokens) / elapsed, "output_tokens_per_s": out_tokens / elapsed,
            "num_output_tokens": out_tokens, **spec_decode_stats(llm)}


def spec_decode_stats(llm: Any) -> dict[str, Any]:
    """Speculative decoding's acceptance over the engine's life (warm-up included), where it is on."""
    if llm.llm_engine.config.scheduler_config.speculative_config is None:
        return {}
    stats = llm.get_stats()
    return {"spec_decode": {"num_drafts": stats.spec_num_drafts, "num_draft_tokens": stats.spec_num_draft_tokens,
                            "num_accepted_tokens": stats.spec_num_accepted_tokens,
                            "acceptance_rate": stats.spec_acceptance_rate,
                            "mean_accepted_length": stats.spec_mean_accepted_length}}


def bench_latency(model: str, w: OfflineWorkload, batch_size: int = 1, num_iters_warmup: int = 2,
                  num_iters: int = 5, **engine_kwargs: Any) -> dict[str, Any]:
    """End-to-end latency of one batch of ``batch_size`` requests, iterated; plus the time to
    first token of the same batch (max_tokens=1) and the decode rate that follows."""
    from dabba import LLM, SamplingParams

    llm = LLM(model, **engine_kwargs)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(
        OfflineWorkload(batch_size, w.input_len, w.output_len, w.dataset, w.dataset_path, w.seed, w.prefix_len),
        llm.llm_engine.model_info.vocab_size, llm.get_tokenizer())]
    full = SamplingParams(temperature=0, max_tokens=w.output_len, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def timed(params: SamplingParams) -> float:
        llm.reset_prefix_cache()  # every iteration prefills its whole prompt, as the first user's would
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(num_iters_warmup):
        timed(full)
    latencies = [timed(full) for _ in range(num_iters)]
    ttfts = [timed(first) for _ in range(num_iters)]
    decode_s = statistics.median(latencies) - statistics.median(ttfts)
    return {"benchmark": "latency", "model": model, "workload": {**asdict(w), "batch_size": batch_size},
            "engine": engine_kwargs, "latency_s": _percentiles(latencies), "ttft_s": _percentiles(ttfts),
            "decode_tokens_per_s": batch_size * (w.output_len - 1) / decode_s if decode_s > 0 else None,
            "prefix_cache_hit_tokens": llm.get_stats().prefix_cache_hit_tokens, **spec_decode_stats(llm)}


def add_workload_args(parser: argparse.ArgumentParser, num_prompts: bool = True) -> None:
    if num_prompts:
        parser.add_argument("--num-prompts", type=int, default=64, help="requests (default: 64)")
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens per request (default: 256)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request (default: 128)")
    parser.add_argument("--dataset", choices=["random", "file"], default="random",
                        help="random token ids, or windows of --dataset-path's text (default: random)")
    parser.add_argument("--dataset-path", default=None, help="a UTF-8 text file, with --dataset file")
    parser.add_argument("--dataset-seed", type=int, default=0, help="dataset seed (default: 0)")
    parser.add_argument("--prefix-len", type=int, default=0,
                        help="random dataset: shared prefix tokens before each prompt's own --input-len (default: 0)")
    parser.add_argument("--json-out", default=None, help="also write the JSON result to this file")


def workload_from_args(args: argparse.Namespace) -> OfflineWorkload:
    return OfflineWorkload(getattr(args, "num_prompts", 1), args.input_len, args.output_len, args.dataset,
                           args.dataset_path, args.dataset_seed, args.prefix_len)
