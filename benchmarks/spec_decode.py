"""Speculative decoding (n-gram proposals, or a draft model with --draft) against plain decoding:
decode tokens/s of each, in one process, alternating, greedy, with whether both gave the same
tokens. Prints JSON.

    python -m benchmarks.spec_decode --model DIR [--workload grounded|random|heldout] [--batch-size 1]
        [--num-prompts N] [--input-len 128] [--output-len 64] [--spread-lengths] [--num-speculative-tokens 4]
        [--rounds 3] [--draft DIR] [--fixed-drafts]
        [--gguf DIR/gguf/model-bf16.gguf --llamacpp-python /tmp/peers/llamacpp/bin/python]

Workloads: "random" prompts are random token ids; "grounded" prompts are a random passage followed
by its first half again, so a model that continues the copy repeats spans of its prompt (as edits
and quotations do); "heldout" prompts are passages of the model's heldout.txt (the demo model's
text it never trained on), which a trained model continues as prose, not as a loop. Both engines load the same checkpoint in one process and take turns, so that
a process's draw of memory bandwidth on these VMs (benchmarks/layer_loop.py) falls on both alike.
A round's rate is the batch's generated tokens over the generate's time (prefill included: it is
the same for both).

--batch-size is how many requests run at once (max_num_seqs); --num-prompts (default: the batch
size) is how many the round serves. With more prompts than slots, a request that finishes early
hands its slot to a waiting one, as at a server with that many clients in flight; with as many, the
round is one offline batch, whose end is set by its slowest request. --spread-lengths gives each
prompt its own output length, drawn (seeded, the same for both engines) from half to one and a half
--output-len: requests then end at different steps with or without speculation, as under EOS, and
a freed slot's prompt is prefilled beside the others' decodes in both runs, where equal lengths
let the plain engine prefill a whole wave of prompts in one step. The speculative engine's acceptance over all its rounds is reported too.

With --gguf (the same weights converted, benchmarks/peers/make_shapes.py) and --llamacpp-python,
llama.cpp runs the same prompts with and without its prompt lookup decoding
(benchmarks/peers/llamacpp_lookup_runner.py, in its own venv and process, one prompt at a time:
llama-cpp-python speculates for one sequence), and the report adds dabba's speculative rate over
llama.cpp's, and whether llama.cpp's greedy tokens are dabba's.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from dabba import LLM, SamplingParams
from dabba.tools.bench.offline import OfflineWorkload, make_prompts, spec_decode_stats


def workload_prompts(kind: str, num_prompts: int, input_len: int, llm: LLM) -> list[list[int]]:
    if kind == "heldout":
        path = Path(llm.llm_engine.config.model_config.model) / "heldout.txt"
        if not path.is_file():
            raise SystemExit(f"--workload heldout reads {path}, which is missing (the demo model has one)")
        ids = llm.get_tokenizer().encode(path.read_text())
        stride = (len(ids) - input_len) // max(num_prompts, 1)
        return [ids[i * stride:i * stride + input_len] for i in range(num_prompts)]
    prompts = make_prompts(OfflineWorkload(num_prompts, input_len, 1), llm.llm_engine.model_info.vocab_size)
    if kind == "grounded":
        return [p + p[: len(p) // 2] for p in prompts]
    return prompts


def run(model: str, workload: str, batch_size: int, input_len: int, output_len: int, num_speculative_tokens: int,
        rounds: int, draft: str | None = None, adaptive_drafts: bool = True,
        num_prompts: int | None = None, spread_lengths: bool = False) -> dict[str, Any]:
    num_prompts = num_prompts or batch_size
    rng = random.Random(0)
    lengths = ([rng.randint(output_len // 2, output_len * 3 // 2) for _ in range(num_prompts)]
               if spread_lengths else [output_len] * num_prompts)
    config = ({"model": draft, "num_speculative_tokens": num_speculative_tokens} if draft else
              {"method": "ngram", "num_speculative_tokens": num_speculative_tokens, "prompt_lookup_min": 2,
               "prompt_lookup_max": 4})
    config["adaptive_drafts"] = adaptive_drafts
    options = dict(enable_prefix_caching=False, max_num_seqs=max(batch_size, 1))
    llms = {"spec": LLM(model, speculative_config=config, **options), "plain": LLM(model, **options)}
    prompts = [{"prompt_token_ids": p} for p in workload_prompts(workload, num_prompts, input_len, llms["plain"])]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    rates: dict[str, list[float]] = {k: [] for k in llms}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(rounds):
        for name, llm in llms.items():
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            rates[name].append(sum(lengths) / (time.perf_counter() - start))
            tokens[name] = [o.outputs[0].token_ids for o in outs]
    medians = {k: statistics.median(v) for k, v in rates.items()}
    return {"prompts": [p["prompt_token_ids"] for p in prompts], "dabba_tokens": tokens["plain"], "model": model, "workload": workload, "batch_size": batch_size, "num_prompts": num_prompts, "input_len": len(prompts[0]["prompt_token_ids"]),
            "output_len": output_len, "spread_lengths": spread_lengths, "speculative_config": config, "tok_s": rates,
            "median_spec_over_plain": medians["spec"] / medians["plain"], "same_tokens": tokens["spec"] == tokens["plain"],
            **spec_decode_stats(llms["spec"])}


def run_llamacpp(python: str, gguf: str, prompts: list[list[int]], output_len: int, num_speculative_tokens: int,
                 rounds: int, threads: int) -> dict[str, Any]:
    runner = Path(__file__).resolve().parent / "peers" / "llamacpp_lookup_runner.py"
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump({"prompts": prompts, "output_len": output_len, "num_pred_tokens": num_speculative_tokens,
                   "max_ngram_size": 4, "rounds": rounds, "threads": threads}, f)
        f.flush()
        out = subprocess.run([python, str(runner), "--gguf", gguf, "--spec", f.name], check=True,
                             stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--workload", choices=["grounded", "random", "heldout"], default="grounded")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, help="prompts per round (default: --batch-size)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--spread-lengths", action="store_true",
                        help="output lengths drawn from half to 1.5x --output-len, one per prompt (seeded)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--draft", help="a draft model's directory: speculate with it instead of n-gram lookup")
    parser.add_argument("--fixed-drafts", action="store_true",
                        help="always num_speculative_tokens drafts (adaptive_drafts false; default: adaptive)")
    parser.add_argument("--gguf", help="the same weights as GGUF, for llama.cpp's lookup decoding")
    parser.add_argument("--llamacpp-python", help="the llama.cpp venv's python (scripts/peers-bench.sh)")
    args = parser.parse_args()
    if bool(args.gguf) != bool(args.llamacpp_python):
        parser.error("--gguf and --llamacpp-python go together")
    if args.num_prompts is not None and args.num_prompts < args.batch_size:
        parser.error("--num-prompts is at least --batch-size (the slots it keeps full)")
    if args.gguf and (args.batch_size != 1 or (args.num_prompts or 1) != 1):
        parser.error("llama.cpp's lookup decoding runs one sequence: --batch-size 1 with --gguf")
    if args.gguf and args.draft:
        parser.error("--gguf compares llama.cpp's lookup decoding, not a draft model: drop one")
    result = run(args.model, args.workload, args.batch_size, args.input_len, args.output_len,
                 args.num_speculative_tokens, args.rounds, args.draft, not args.fixed_drafts, args.num_prompts,
                 args.spread_lengths)
    prompts, dabba_tokens = result.pop("prompts"), result.pop("dabba_tokens")
    if args.gguf:
        import torch

        peer = run_llamacpp(args.llamacpp_python, args.gguf, prompts, args.output_len, args.num_speculative_tokens,
                            args.rounds, torch.get_num_threads())
        result["llamacpp"] = {"tok_s": peer["tok_s"], "median_lookup_over_plain": peer["median_lookup_over_plain"],
                              "same_tokens_as_its_plain": peer["same_tokens"],
                              "same_tokens_as_dabba": peer["tokens"] == dabba_tokens}
        result["dabba_spec_over_llamacpp_lookup"] = (statistics.median(result["tok_s"]["spec"])
                                                     / statistics.median(peer["tok_s"]["lookup"]))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
