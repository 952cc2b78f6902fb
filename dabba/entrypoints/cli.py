"""The ``dabba`` command. Engine flags are generated from the config dataclasses, so every
option has exactly one definition and one help text."""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Sequence

from dabba.config import DEMO_MODEL, EngineConfig, ServerConfig
from dabba.config_fields import parse_bytes, parse_keep_alive
from dabba.entrypoints.cli_args import add_config_args, add_engine_args, config_kwargs, engine_kwargs
from dabba.entrypoints.openai.reasoning import REASONING_PARSERS
from dabba.entrypoints.openai.tool_call_parsers import TOOL_CALL_PARSERS
from dabba.entrypoints.cli_tools import (cmd_bench_embed, cmd_bench_latency, cmd_bench_serve, cmd_bench_throughput,
                                         cmd_eval_kl_divergence, cmd_eval_perplexity, cmd_plan, cmd_quantize)
from dabba.logger import init_logger
from dabba.router_config import RouterConfig

SERVER_PARTS = {"server_config": ServerConfig}
ROUTER_PARTS = {"router_config": RouterConfig}

def _text_or_file(value: str) -> str:
    """A flag's value, or the contents of the file it names with a leading @ (curl's convention)."""
    if value.startswith("@"):
        try:
            return Path(value[1:]).read_text()
        except OSError as e:
            raise ValueError(f"cannot read {value[1:]}: {e.strerror}") from None
    return value


def structured_outputs_of(args: argparse.Namespace):
    """--json-schema / --regex / --choice / --grammar / --json-object -> StructuredOutputsParams."""
    from dabba.structured_output import StructuredOutputsParams

    fields = {"json": _text_or_file(args.json_schema) if args.json_schema else None,
              "regex": args.regex, "choice": args.choice,
              "grammar": _text_or_file(args.grammar) if args.grammar else None,
              "json_object": args.json_object or None}
    if not any(v is not None for v in fields.values()):
        return None
    params = StructuredOutputsParams(**fields)
    from dabba.structured_output.grammar import build_grammar

    build_grammar(params)  # a bad schema, regex or grammar is a ValueError naming the field, now
    return params


def cmd_generate(args: argparse.Namespace) -> int:
    from dabba import LLM, SamplingParams

    structured = structured_outputs_of(args)  # a bad constraint fails before the model loads
    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos,
                            structured_outputs=structured)
    outputs = llm.generate(args.prompt, params, use_tqdm=len(args.prompt) > 1)
    for out in outputs:
        completion = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": completion.text, "token_ids": completion.token_ids,
                              "finish_reason": completion.finish_reason}))
        else:
            print(f"{out.prompt}{completion.text}")
            print(f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.models or args.models_file:
        return serve_models(args)
    from dabba.engine.clients import make_engine_client
    from dabba.engine.data_parallel import build_replicas
    from dabba.engine.llm_engine import LLMEngine
    from dabba.entrypoints.openai.adapters import parse_lora_modules
    from dabba.entrypoints.openai.run_server import serve

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_CALL_PARSERS)})")
    server_config = ServerConfig(**config_kwargs(args, SERVER_PARTS))  # a bad bound fails before the model loads
    lora_modules = parse_lora_modules(args.lora_modules or [])
    if lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    config = EngineConfig.from_kwargs(model=args.model, **engine_kwargs(args))
    engine = LLMEngine(config) if config.parallel_config.data_parallel_size == 1 else build_replicas(config)
    name = args.served_model_name or ("demo" if args.model == DEMO_MODEL else args.model)
    client = make_engine_client(engine, name, start_thread=False)  # serve() runs its loop on this thread
    return serve(client, name, args.host, args.port, args.api_key,
                 args.tool_call_parser if args.enable_auto_tool_choice else None, server_config, args.reasoning_parser,
                 lora_modules)


def serve_models(args: argparse.Namespace) -> int:
    """`dabba serve --model NAME=PATH ...` or `--models-file FILE`: several models, each loaded on first use."""
    from dabba.engine.model_router import ModelRouter
    from dabba.entrypoints.models_file import parse_model_flags, read_models_file
    from dabba.entrypoints.openai.api_server import build_router_app
    from dabba.entrypoints.openai.run_server import run_app
    from dabba.entrypoints.openai.model_servings import ServingOptions
    from dabba.worker.memory import available_cpu_memory

    if args.model != DEMO_MODEL:
        raise ValueError("give the models either as MODEL or as --model NAME=PATH / --models-file, not both")
    if args.lora_modules or args.served_model_name:
        raise ValueError("with several models, give each one's adapters and name in the models file "
                         "(lora_modules, name), not --lora-modules / --served-model-name")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_CALL_PARSERS)})")
    server_config = ServerConfig(**config_kwargs(args, SERVER_PARTS))
    router_config = RouterConfig(**config_kwargs(args, ROUTER_PARTS))
    options = ServingOptions(args.tool_call_parser if args.enable_auto_tool_choice else None, args.reasoning_parser)
    defaults, keep_alive = engine_kwargs(args), parse_keep_alive(router_config.keep_alive)
    served = parse_model_flags(args.models or [], defaults, keep_alive, options)
    if router_config.models_file:
        served += read_models_file(router_config.models_file, defaults, keep_alive, options)
    names = [m.spec.name for m in served]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must differ, got {names}")
    budget = router_config.models_memory or int(available_cpu_memory() * 0.9)
    router = ModelRouter([m.spec for m in served], budget, router_config.max_waiting_per_model)
    router.plan()
    app = build_router_app(router, {m.spec.name: m.options for m in served}, args.api_key, server_config,
                           {m.spec.name: m.lora_modules for m in served})
    return run_app(app, router, args.host, args.port, server_config, f"{len(served)} models ({', '.join(names)})")


def cmd_chat(args: argparse.Namespace) -> int:
    """A terminal chat that streams the reply as it is generated; an empty line or EOF ends it."""
    from dabba.engine.llm_engine import LLMEngine
    from dabba.sampling_params import RequestOutputKind, SamplingParams

    engine = LLMEngine(EngineConfig.from_kwargs(model=args.model, **engine_kwargs(args)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            output_kind=RequestOutputKind.DELTA)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    turn = 0
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        text = engine.model_info.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        engine.add_request(f"chat-{turn}", {"prompt": text, "prompt_token_ids": engine.model_info.tokenizer.encode(
            text, add_special_tokens=False)}, params)
        reply = ""
        print("assistant> ", end="", flush=True)
        while engine.has_unfinished_requests():
            for out in engine.step():  # DELTA: only the newly released text
                reply += out.outputs[0].text
                print(out.outputs[0].text, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": reply})
        turn += 1
    return 0


LOG_LEVELS = ("debug", "info", "warning", "error")


def _common_flags() -> argparse.ArgumentParser:
    """Flags of every command (given after its name, as its own flags are)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                        help="dabba's and the server's logging; debug also prints an error's traceback (default: info)")
    return common


def _model_command(sub, name: str, help_text: str, func) -> argparse.ArgumentParser:
    """A subcommand that runs a model: MODEL (default: the demo model) plus every engine flag."""
    cmd = sub.add_parser(name, help=help_text, parents=[_common_flags()])
    cmd.add_argument("model", nargs="?", default=DEMO_MODEL,
                     help="a Hugging Face checkpoint directory or Hub repo id (default: the bundled demo model)")
    cmd.set_defaults(func=func)
    return cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dabba", description="dabba: serve and run LLMs from Hugging Face checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = _model_command(sub, "generate", "generate text for one or more prompts, no server", cmd_generate)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    so = gen.add_argument_group("structured outputs (at most one)")
    so.add_argument("--json-schema", default=None, help="the output matches this JSON schema (text, or @FILE)")
    so.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    so.add_argument("--regex", default=None, help="the output matches this regular expression")
    so.add_argument("--choice", action="append", default=None, help="the output is one of these (repeat the flag)")
    so.add_argument("--grammar", default=None, help="the output follows this EBNF/GBNF grammar (root rule "
                    "'root'; text, or @FILE)")

    srv = _model_command(sub, "serve", "serve the model over an OpenAI-compatible HTTP API", cmd_serve)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    srv.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    srv.add_argument("--model", dest="models", action="append", default=None, metavar="NAME=PATH",
                     help="serve several models (repeat the flag; or --models-file): each loads on its first "
                          "request, as NAME, with the engine flags given")
    srv.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                     help="LoRA adapters (PEFT directories) served from the start, each under its NAME as the "
                          "request's model (needs --enable-lora); more load at run time: POST /v1/load_lora_adapter")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help='tool_choice "auto" (the default when a request has tools): read calls from the reply')
    srv.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                     help="how replies write calls: hermes (Qwen 2.5/3, Hermes: <tool_call> blocks), "
                          "llama3_json (Llama 3.x: a JSON object), mistral ([TOOL_CALLS]), pythonic (Llama "
                          "3.2/4: [f(a=1)]) or qwen3_coder (Qwen3-Coder's <function=...> XML)")
    srv.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                     help="split a reasoning model's <think> block from its answer (reasoning_content): qwen3 "
                          "(the reply opens the block) or deepseek_r1 (the prompt opens it: DeepSeek-R1, QwQ, "
                          "Qwen3's thinking-only models)")

    chat = _model_command(sub, "chat", "chat in the terminal, the reply streamed as it is generated", cmd_chat)
    chat.add_argument("--system", default=None, help="a system message")
    chat.add_argument("--max-tokens", type=int, default=256, help="longest reply (default: 256)")
    chat.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default: 0.7)")

    ev = sub.add_parser("eval", help="evaluate a model").add_subparsers(dest="metric", required=True)
    ppl = _model_command(ev, "perplexity", "perplexity on a text file, in sliding windows; prints JSON",
                         cmd_eval_perplexity)
    ppl.add_argument("--data", required=True, help="a UTF-8 text file")
    ppl.add_argument("--max-length", type=int, default=256, help="tokens per window (default: 256)")
    ppl.add_argument("--stride", type=int, default=128, help="tokens between window starts (default: 128)")
    for cmd in (gen, srv, chat, ppl):
        add_engine_args(cmd)
    add_config_args(srv, SERVER_PARTS)
    add_config_args(srv, ROUTER_PARTS)
    kld = _model_command(ev, "kl-divergence", "KL divergence of MODEL's next-token distributions from a reference "
                         "model's (e.g. quantized vs full precision) on a text file; prints JSON",
                         cmd_eval_kl_divergence)
    kld.add_argument("--reference", required=True, help="the reference checkpoint (same tokenizer)")
    kld.add_argument("--data", required=True, help="a UTF-8 text file")
    kld.add_argument("--quantization", choices=["int8", "int4", "w8a8"], default=None, help="quantize MODEL at load time")
    kld.add_argument("--dtype", default="auto", help='"auto" (the reference\'s), "bfloat16", "float16", "float32"')
    kld.add_argument("--max-length", type=int, default=256, help="tokens per window (default: 256)")
    kld.add_argument("--max-windows", type=int, default=64, help="non-overlapping windows to score (default: 64)")

    pl = _model_command(sub, "plan", "weights and KV-cache memory, and how many sequences fit, for each weight "
                        "quantization and KV-cache dtype (loads no weights)", cmd_plan)
    pl.add_argument("--kv-cache-memory", type=parse_bytes, default=None, help="KV-cache budget (default: 4GiB)")
    pl.add_argument("--memory", type=parse_bytes, default=None,
                    help="instead: memory for weights and KV cache together; the KV cache gets the rest")
    pl.add_argument("--max-model-len", type=int, default=None, help="sequence length (default: the model's limit)")
    pl.add_argument("--quantization", choices=["none", "int8", "int4", "w8a8"], default=None,
                    help="only this weight quantization")
    pl.add_argument("--kv-cache-dtype", choices=["auto", "int8", "fp8"], default=None, help="only this KV dtype")
    pl.add_argument("--dtype", default="auto", help='"auto" (config.json\'s), "bfloat16", "float16", "float32"')
    pl.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    pl.add_argument("--max-num-batched-tokens", type=int, default=4096,
                    help="the engine's token budget per step: a sliding-window layer holds its window plus this "
                         "(default: 4096)")
    pl.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="plan one rank of this many: its shard of the weights, its KV heads, its memory (default: 1)")
    pl.add_argument("--load-time", action="store_true",
                    help="also predict each row's load time on this machine, from rates measured now (reads a "
                         "sample of the checkpoint's files and processes one projection)")
    pl.add_argument("--json", action="store_true", help="print JSON")
    pl.add_argument("--revision", default=None, help="the Hub revision of a model given as a repo id (default: main)")
    pl.add_argument("--download-dir", default=None,
                    help="where Hub downloads go (default: the Hugging Face cache); a plan fetches config.json only")

    from dabba.tools.bench.offline import add_workload_args

    bench = sub.add_parser("bench", help="benchmarks; print JSON").add_subparsers(dest="benchmark", required=True)
    tp = _model_command(bench, "throughput", "offline throughput: all requests at once through the engine",
                        cmd_bench_throughput)
    add_workload_args(tp)
    lat = _model_command(bench, "latency", "latency of one batch, end to end and to the first token",
                         cmd_bench_latency)
    add_workload_args(lat, num_prompts=False)
    lat.add_argument("--batch-size", type=int, default=1, help="requests in the batch (default: 1)")
    lat.add_argument("--num-iters-warmup", type=int, default=2, help="untimed iterations first (default: 2)")
    lat.add_argument("--num-iters", type=int, default=5, help="timed iterations (default: 5)")
    emb = _model_command(bench, "embed", "embedding throughput: documents/s and tokens/s", cmd_bench_embed)
    emb.add_argument("--num-prompts", type=int, default=512, help="inputs (default: 512)")
    emb.add_argument("--input-len", type=int, default=256, help="tokens per input, about (default: 256)")
    emb.add_argument("--batch-size", type=int, default=None, help="inputs per embed() call (default: all at once)")
    emb.add_argument("--dataset-seed", type=int, default=0, help="dataset seed (default: 0)")
    emb.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    for cmd in (tp, lat, emb):
        add_engine_args(cmd)
    from dabba.tools.bench.serve import add_serve_args

    bs = bench.add_parser("serve", parents=[_common_flags()], help="online: Poisson arrivals against any OpenAI-compatible server (dabba's "
                          "or vllm serve); TTFT, TPOT, ITL, end-to-end latency, goodput")
    add_serve_args(bs)
    bs.set_defaults(func=cmd_bench_serve)

    qz = sub.add_parser("quantize", parents=[_common_flags()], help="quantize a checkpoint: GPTQ or round-to-nearest (saved in "
                        "GPTQ's layout), AWQ (saved in AutoAWQ's gemm layout), W8A8 (saved as compressed-tensors' "
                        "int-quantized checkpoint, as llm-compressor writes it)")
    qz.add_argument("model", help="a Hugging Face checkpoint directory or Hub repo id")
    qz.add_argument("out", help="directory to write the quantized checkpoint to")
    qz.add_argument("--method", choices=["gptq", "awq", "rtn", "w8a8", "smoothquant"], default="gptq",
                    help="smoothquant: SmoothQuant's scales folded into the norms, then w8a8")
    qz.add_argument("--bits", type=int, choices=[4, 8], default=None, help="(default: 4; w8a8, smoothquant: 8)")
    qz.add_argument("--alpha", type=float, default=0.5,
                    help="smoothquant: how much of the activations' range moves into the weights, 0-1 (default: 0.5)")
    qz.add_argument("--group-size", type=int, default=128, help="input channels per scale (default: 128)")
    qz.add_argument("--act-order", action="store_true", help="GPTQ: columns in decreasing Hessian-diagonal order")
    qz.add_argument("--activations", choices=["dynamic", "static"], default="dynamic",
                    help="w8a8: activations rounded per token at run time (default), or with one scale per layer "
                         "from the calibration inputs' range")
    qz.add_argument("--asymmetric-activations", action="store_true",
                    help="w8a8: activation codes with a zero point (over [min, max] rather than [-max|x|, max|x|])")
    qz.add_argument("--calibration", default=None, help="calibration text (default: MODEL/calibration.txt)")
    qz.add_argument("--num-samples", type=int, default=64, help="calibration windows (default: 64)")
    qz.add_argument("--seq-len", type=int, default=256, help="tokens per calibration window (default: 256)")
    qz.add_argument("--revision", default=None, help="the Hub revision of a model given as a repo id (default: main)")
    qz.add_argument("--download-dir", default=None,
                    help="where a repo id's files are downloaded (default: the Hugging Face cache)")
    qz.set_defaults(func=cmd_quantize)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Bad arguments, a broken or unfitting model: one line on stderr and exit status 2 (the
    traceback too with --log-level debug)."""
    args = build_parser().parse_args(argv)
    init_logger().setLevel(args.log_level.upper())
    try:
        return args.func(args)
    except ValueError as e:
        if args.log_level == "debug":
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
