"""The ``dabba`` command's offline tools: eval, plan, bench and quantize (cli.py registers them)."""
from __future__ import annotations

import argparse
import json
import sys

from dabba.entrypoints.cli_args import engine_kwargs


def cmd_eval_perplexity(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dabba import LLM
    from dabba.tools.evaluation import perplexity

    llm = LLM(args.model, **engine_kwargs(args))
    result = perplexity(llm, Path(args.data).read_text(), args.max_length, args.stride)
    print(json.dumps({"model": args.model, "data": args.data,
                      "quantization": getattr(args, "quantization", None), **result.to_dict()}))
    return 0


def cmd_eval_kl_divergence(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dabba.tools.evaluation import kl_divergence

    result = kl_divergence(args.model, args.reference, Path(args.data).read_text(), args.quantization, args.dtype,
                           args.max_length, args.max_windows)
    print(json.dumps({"model": args.model, "reference": args.reference, "data": args.data,
                      "quantization": args.quantization, **result.to_dict()}))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from dabba.tools.plan import plan

    kv_memory = None if args.memory is not None and args.kv_cache_memory is None else (args.kv_cache_memory or 4 * 2**30)
    result = plan(args.model, kv_memory, args.max_model_len, args.quantization, args.kv_cache_dtype, args.dtype,
                  args.block_size, total_memory=args.memory, revision=args.revision, download_dir=args.download_dir,
                  max_num_batched_tokens=args.max_num_batched_tokens, tensor_parallel_size=args.tensor_parallel_size,
                  load_time=args.load_time)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.render())
    return 0


def _print_result(result: dict, json_out: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if json_out:
        from pathlib import Path

        Path(json_out).write_text(text + "\n")


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from dabba.tools.bench.offline import bench_throughput, workload_from_args

    _print_result(bench_throughput(args.model, workload_from_args(args), **engine_kwargs(args)), args.json_out)
    return 0


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from dabba.tools.bench.offline import bench_latency, workload_from_args

    result = bench_latency(args.model, workload_from_args(args), args.batch_size, args.num_iters_warmup,
                           args.num_iters, **engine_kwargs(args))
    _print_result(result, args.json_out)
    return 0


def cmd_bench_embed(args: argparse.Namespace) -> int:
    from dabba.tools.bench.embed import EmbedWorkload, bench_embed

    workload = EmbedWorkload(args.num_prompts, args.input_len, args.batch_size, args.dataset_seed)
    _print_result(bench_embed(args.model, workload, **engine_kwargs(args)), args.json_out)
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio

    from dabba.tools.bench.serve import run_serve_benchmark, serve_config_from_args
    from dabba.tools.bench.serve_report import format_serve_result, save_serve_outputs

    result = asyncio.run(run_serve_benchmark(serve_config_from_args(args)))
    save_serve_outputs(result, args.json_out, args.chart)
    print(format_serve_result(result), file=sys.stderr)
    print(json.dumps({k: v for k, v in result.items() if k != "requests"}, indent=2))
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dabba.models.hub import resolve_model_dir
    from dabba.tools.quantize import QuantizeOptions, quantize_checkpoint

    model_dir = resolve_model_dir(args.model, args.revision, args.download_dir)
    w8a8 = args.method in ("w8a8", "smoothquant")
    opts = QuantizeOptions(method=args.method, bits=args.bits or (8 if w8a8 else 4),
                           group_size=args.group_size, act_order=args.act_order, num_samples=args.num_samples,
                           seq_len=args.seq_len, static_activations=args.activations == "static",
                           asymmetric_activations=args.asymmetric_activations, alpha=args.alpha)
    calibration = args.calibration or str(model_dir / "calibration.txt")
    needed = args.method != "w8a8" or opts.static_activations  # dynamic W8A8 rounds to nearest
    if needed and not Path(calibration).is_file():
        raise ValueError(f"no calibration text: pass --calibration FILE ({calibration} does not exist)")
    config = quantize_checkpoint(model_dir, args.out, Path(calibration).read_text() if needed else "", opts)
    print(json.dumps({"out": args.out, "quantization_config": config}))
    return 0
