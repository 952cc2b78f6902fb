"""dabba on an accelerator: right, and how fast, against transformers on the same device.

What a session lent a GPU runs, in one short call (the code is device-agnostic; CPU kernels and
their tests cover the rest):

    python -m benchmarks.device_check --device cuda [--shape qwen2.5-1.5b] [--out DIR]

Parity, on every family's tiny random checkpoint (tests/conftest.py's CHECKPOINTS) in float32:
dabba's greedy token ids against transformers' generate on the same device, whole and in chunked
prefill with prefix caching, and the generated tokens' logprobs against transformers' log-softmax.
On the llama checkpoint also n-gram speculative decoding (equal to plain greedy), and load-time
INT8 / W8A8 and the 8-bit KV caches, which change the numbers: their tokens are counted against
dabba's own run of the same setting on the CPU (the reference the CPU tests hold equal) and against
the float run. Speed, on a real shape with random bf16 weights: batch-1 decode tok/s with the
decode's share of the device's read bandwidth (the weights' bytes a token / time; the bandwidth a
device-to-device copy reaches, measured here), time to first token of 2048 tokens, and 32 x 256 -> 64
total tok/s, dabba against transformers' generate. Prints one JSON object (and writes it to
OUT/device_check.json).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

NUM_NEW = 32
QUANTIZED = ({"quantization": "int8"}, {"quantization": "w8a8"}, {"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "fp8"})
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive_drafts": False}


def guarded(results: dict, key: str, fn: Callable[[], Any]) -> None:
    """One check's result under ``key``, or its error: one failure must not hide the others."""
    start = time.perf_counter()
    try:
        results[key] = fn()
    except Exception as e:  # reported, not raised: the point is to see every path on a rare machine
        results[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    print(f"device_check: {key} ({time.perf_counter() - start:.1f} s): {json.dumps(results[key])[:300]}",
          file=sys.stderr, flush=True)


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def greedy_ids(llm, prompts: list[list[int]], num_new: int = NUM_NEW, logprobs: int | None = None) -> list:
    from dabba import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=num_new, ignore_eos=True, logprobs=logprobs)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Equal sequences, and the share of positions equal up to each pair's first difference."""
    prefix = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s)) for s, t in zip(a, b)]
    return {"equal": sum(s == t for s, t in zip(a, b)), "of": len(a),
            "tokens_before_first_difference": sum(prefix) / sum(len(s) for s in a)}


def hf_model(path: Path, device: str, dtype: torch.dtype, attention: str | None = "eager"):
    """Parity takes transformers' eager attention, the plain reference: some versions (5.17) default
    Gemma 2 to SDPA, which drops its attention soft cap (every greedy output then differs from
    eager's). Speed takes its default (``attention=None``)."""
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": attention} if attention else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()


def family_parity(name: str, spec: dict, device: str, work: Path) -> dict[str, Any]:
    """One family: dabba against transformers on ``device``, whole and chunked, and logprobs."""
    from dabba import LLM
    from tests.conftest import INIT_STD, hf_greedy, make_prompts
    from tools.tiny_checkpoint import make_checkpoint

    spec = dict(spec)
    path = make_checkpoint(work / name, spec.pop("arch"), initializer_range=INIT_STD, **spec)
    model = hf_model(path, device, torch.float32)
    prompts = make_prompts(model.config.vocab_size)
    with torch.inference_mode():
        reference = hf_greedy(_OnDevice(model, device), prompts, NUM_NEW)
    result: dict[str, Any] = {}
    for label, kwargs in (("whole", {}), ("chunked_prefix_cached", {"max_num_batched_tokens": 40})):
        llm = LLM(str(path), dtype="float32", device=device, **kwargs)
        outs = greedy_ids(llm, prompts, logprobs=1 if label == "whole" else None)
        result[label] = agreement([o.token_ids for o in outs], reference)
        if label == "whole":
            result["max_logprob_difference"] = _logprob_difference(model, prompts, outs, device)
        if label == "chunked_prefix_cached":  # the two prompts sharing a 150-token prefix hit the cache
            result["prefix_hit_tokens"] = llm.get_stats().prefix_cache_hit_tokens
        del llm
        free(device)
    del model
    free(device)
    return result


class _OnDevice:
    """transformers' model with generate()'s inputs moved to its device (hf_greedy builds them on the CPU)."""

    def __init__(self, model, device: str) -> None:
        self.model, self.device = model, device

    def generate(self, input_ids, attention_mask, **kwargs):
        return self.model.generate(input_ids.to(self.device), attention_mask=attention_mask.to(self.device), **kwargs)


def _logprob_difference(model, prompts: list[list[int]], outs: list, device: str) -> float:
    """The largest gap between dabba's chosen-token logprobs and transformers' log-softmax."""
    worst = 0.0
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt + out.token_ids], device=device)
            ref = model(ids).logits[0].float().log_softmax(dim=-1).cpu()
            for j, (token, position) in enumerate(zip(out.token_ids, out.logprobs)):
                worst = max(worst, abs(position[token].logprob - ref[len(prompt) + j - 1, token].item()))
    return worst


def llama_settings(device: str, work: Path) -> dict[str, Any]:
    """Speculative decoding against plain greedy; the 8-bit settings against dabba's CPU run of each."""
    from dabba import LLM
    from tests.conftest import make_prompts

    path = work / "llama"  # family_parity made it
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(vocab)

    def run(dev: str, **kwargs) -> list[list[int]]:
        llm = LLM(str(path), dtype="float32", device=dev, **kwargs)
        ids = [o.token_ids for o in greedy_ids(llm, prompts)]
        del llm
        free(dev)
        return ids

    plain = run(device)
    result: dict[str, Any] = {"ngram_spec_decode_vs_plain": agreement(run(device, speculative_config=NGRAM), plain)}
    for kwargs in QUANTIZED:
        label = "_".join(f"{k}={v}" for k, v in kwargs.items())
        guarded(result, label, lambda kwargs=kwargs: {"vs_cpu": agreement(on := run(device, **kwargs),
                                                                           run("cpu", **kwargs)),
                                                      "vs_float": agreement(on, plain)})
    return result


def read_bandwidth(device: str) -> float:
    """GB/s of bytes read by a device-to-device copy of 2 GiB (half of the bytes it moves)."""
    n = 2**31
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return n * 10 / (time.perf_counter() - start) / 1e9


def speed(shape_name: str, device: str, work: Path) -> dict[str, Any]:
    """The shape's decode, TTFT and batch figures, dabba's engine and transformers' generate."""
    from benchmarks.peers.make_shapes import SHAPES
    from dabba.tools.bench.offline import OfflineWorkload, bench_latency, bench_throughput
    from tools.tiny_checkpoint import make_checkpoint

    shape = SHAPES[shape_name]
    start = time.perf_counter()
    path = make_checkpoint(work / shape_name, shape.arch, dtype="bfloat16", **shape.config)
    result: dict[str, Any] = {"shape": shape_name, "checkpoint_s": time.perf_counter() - start}
    engine = dict(dtype="bfloat16", device=device, max_model_len=4096)
    weight_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    if not shape.config.get("tie_word_embeddings"):
        weight_bytes -= shape.config["vocab_size"] * shape.config["hidden_size"] * 2  # the input embedding isn't read
    result["weight_bytes_per_token"] = weight_bytes
    if device.startswith("cuda"):
        result["device_read_gb_s"] = read_bandwidth(device)

    def dabba_figures() -> dict[str, Any]:
        decode = bench_latency(str(path), OfflineWorkload(1, 128, 256), 1, 1, 3, **engine)
        free(device)
        ttft = bench_latency(str(path), OfflineWorkload(1, 2048, 2), 1, 1, 3, **engine)
        free(device)
        batch = bench_throughput(str(path), OfflineWorkload(32, 256, 64), **engine)
        free(device)
        out = {"decode_tok_s": decode["decode_tokens_per_s"], "ttft_2048_s": ttft["ttft_s"]["p50"],
               "batch32_total_tok_s": batch["total_tokens_per_s"]}
        if "device_read_gb_s" in result:
            out["decode_share_of_read_bandwidth"] = (out["decode_tok_s"] * weight_bytes / 1e9 / result["device_read_gb_s"])
        return out

    guarded(result, "dabba", dabba_figures)
    guarded(result, "transformers", lambda: hf_speed(path, device))
    free(device)
    for key in ("decode_tok_s", "batch32_total_tok_s"):
        d, t = result["dabba"].get(key), result["transformers"].get(key)
        if d and t:
            result[f"{key}_ratio_dabba_over_transformers"] = d / t
    return result


def hf_speed(path: Path, device: str) -> dict[str, Any]:
    """transformers' generate (its default attention, dynamic cache, not compiled) on the same
    workloads, greedy, EOS ignored."""
    model = hf_model(path, device, torch.bfloat16, attention=None)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)

    def generate(batch: int, input_len: int, new: int) -> float:
        ids = torch.randint(3, vocab, (batch, input_len), generator=g).to(device)
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
        sync()
        return time.perf_counter() - start

    generate(1, 128, 8)  # warm-up
    ttft = min(generate(1, 2048, 1) for _ in range(3))
    first = min(generate(1, 128, 1) for _ in range(2))
    decode = generate(1, 128, 256)
    batch = generate(32, 256, 64)
    return {"decode_tok_s": 255 / (decode - first), "ttft_2048_s": ttft, "batch32_total_tok_s": 32 * 320 / batch}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="qwen2.5-1.5b", help="benchmarks/peers/make_shapes.py's shape; '' skips")
    parser.add_argument("--families", default="", help="comma list of tests/conftest.py's families (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="also write device_check.json here")
    args = parser.parse_args(argv)
    from tests.conftest import CHECKPOINTS

    results: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "device": args.device}
    if args.device.startswith("cuda"):
        results["device_name"] = torch.cuda.get_device_name(args.device)
    families = [f for f in args.families.split(",") if f] or list(CHECKPOINTS)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        parity: dict[str, Any] = {}
        for name in families:
            guarded(parity, name, lambda name=name: family_parity(name, CHECKPOINTS[name], args.device, work))
        results["parity"] = parity
        if args.shape:
            guarded(results, "speed", lambda: speed(args.shape, args.device, work))
        if "llama" in families:
            guarded(results, "llama_settings", lambda: llama_settings(args.device, work))
    text = json.dumps(results, indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v) else str(v))
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "device_check.json").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
