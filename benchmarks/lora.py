"""LoRA adapters against the base model on the same requests, each engine in its own process, one
after the other: total tokens/s of --num-prompts requests (--input-len random tokens each,
--output-len greedy tokens, EOS ignored) on the base model alone, on the base model with
enable_lora (its layers then run in Python), and spread round-robin over --num-adapters random
adapters of --rank (q/k/v/o and gate/up/down, as PEFT's all-linear target). Prints one JSON object.

    python -m benchmarks.peers.make_shapes --shapes llama-3.2-1b --no-gguf   # /tmp/shapes/llama-3.2-1b
    python -m benchmarks.lora --model /tmp/shapes/llama-3.2-1b [--num-prompts 32 --num-adapters 4 --rank 16]

The adapters are written (random A and B, PEFT's file layout and names, the model's dtype) under
--adapter-dir, once per shape and rank.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from benchmarks.throughput import random_prompts, run_isolated, summarize
from benchmarks.vision_ttft import _cpu_name

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model: Path, out: Path, rank: int, seed: int) -> None:
    """A PEFT LoRA adapter of ``rank`` on every attention and MLP projection of ``model``, with
    random A and B (std chosen so the adapter moves the outputs without swamping them)."""
    import torch
    from safetensors.torch import save_file

    from dabba.arch.config import ArchConfig
    from dabba.models.lora_adapter import AdapterLimits

    cfg = json.loads((model / "config.json").read_text())
    arch = ArchConfig.from_hf(str(model))
    layers, shapes = arch.num_hidden_layers, AdapterLimits.of(arch, rank).shapes  # what dabba checks adapters by
    dtype = getattr(torch, cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for name in TARGETS:
            n_in, n_out = shapes[name]
            where = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{where}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, n_in, generator=g) / n_in ** 0.5).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(n_out, rank, generator=g) * 0.01).to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": str(model)}))


def run_engine(args: dict[str, Any], prompts: list[list[int]]) -> dict[str, Any]:
    """In this process: one engine over ``prompts``, with the adapters round-robin if any."""
    from dabba import LLM, LoRARequest
    from dabba.tools.bench.offline import warm_and_time

    adapters = [LoRARequest(f"a{k}", k + 1, path) for k, path in enumerate(args["adapters"])]
    kwargs = {"dtype": args["dtype"], "max_num_batched_tokens": args["max_num_batched_tokens"]}
    if args["enable_lora"]:
        kwargs.update(enable_lora=True, max_loras=max(len(adapters), 1), max_lora_rank=args["rank"])
    llm = LLM(args["model"], **kwargs)
    loras = [adapters[k % len(adapters)] for k in range(len(prompts))] if adapters else None
    elapsed, outs = warm_and_time(llm, prompts, args["output_len"], loras)
    return {"elapsed_s": elapsed, "num_output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "layer_loop": llm.llm_engine.engine_core.model_runner.layer_loop_reason}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--adapter-dir", default="/tmp/lora-adapters")
    parser.add_argument("--runs", default="base,base_enable_lora,adapters")
    args = parser.parse_args(argv)
    model = Path(args.model)
    cfg = json.loads((model / "config.json").read_text())
    paths = []
    for k in range(args.num_adapters):
        path = Path(args.adapter_dir) / f"{model.name}-r{args.rank}-{k}"
        if not (path / "adapter_model.safetensors").is_file():
            write_adapter(model, path, args.rank, seed=k)
        paths.append(str(path))
    prompts = random_prompts(args.num_prompts, args.input_len, cfg["vocab_size"], seed=0)
    common = {"model": str(model), "dtype": args.dtype, "max_num_batched_tokens": args.max_num_batched_tokens,
              "output_len": args.output_len, "rank": args.rank}
    runs = {"base": {"enable_lora": False, "adapters": []}, "base_enable_lora": {"enable_lora": True, "adapters": []},
            "adapters": {"enable_lora": True, "adapters": paths}}
    result: dict[str, Any] = {"benchmark": "lora", "model": str(model), "cpu": _cpu_name(), "threads": os.cpu_count(),
                              "num_prompts": args.num_prompts, "input_len": args.input_len,
                              "output_len": args.output_len, "num_adapters": args.num_adapters, "rank": args.rank}
    for name in args.runs.split(","):
        raw = run_isolated("run_engine", {**common, **runs[name]}, prompts)
        result[name] = summarize(raw, args.num_prompts, args.input_len)
    if "base" in result and "adapters" in result:
        result["adapters_vs_base"] = round(result["adapters"]["total_tokens_per_s"]
                                           / result["base"]["total_tokens_per_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
