"""llama.cpp's prompt lookup decoding (llama-cpp-python's LlamaPromptLookupDecoding, batch 1)
against its plain decoding on one GGUF, run with the llama.cpp venv's Python; prints one line of
JSON on stdout. For benchmarks/spec_decode.py's side-by-side figure.

    python benchmarks/peers/llamacpp_lookup_runner.py --gguf FILE --spec SPEC.json

SPEC.json: {"prompts": [[ids], ...], "output_len", "num_pred_tokens", "max_ngram_size", "rounds",
"threads"}. Each prompt runs alone (llama-cpp-python speculates for one sequence), greedy
(temperature 0), EOS ignored by a logits processor that bans it, in a Llama with and one without
the draft "model", taking turns. A round's rate is the prompts' generated tokens over their
generate time (prefill included, as for dabba). Imports nothing of dabba or torch.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import llama_cpp
import numpy as np
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    longest = max(len(p) for p in spec["prompts"]) + spec["output_len"] + 16
    common = dict(model_path=args.gguf, n_ctx=longest, n_threads=spec["threads"], n_threads_batch=spec["threads"],
                  verbose=False)
    llms = {"plain": llama_cpp.Llama(**common),
            "lookup": llama_cpp.Llama(**common, draft_model=LlamaPromptLookupDecoding(
                max_ngram_size=spec["max_ngram_size"], num_pred_tokens=spec["num_pred_tokens"]))}
    eos = llms["plain"].token_eos()

    def no_eos(_ids: np.ndarray, logits: np.ndarray) -> np.ndarray:
        logits[eos] = -np.inf
        return logits

    rates: dict[str, list[float]] = {k: [] for k in llms}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(spec["rounds"]):
        for name, llm in llms.items():
            outs, start = [], time.perf_counter()
            for prompt in spec["prompts"]:
                llm.reset()
                gen = llm.generate(prompt, temp=0.0, logits_processor=llama_cpp.LogitsProcessorList([no_eos]))
                out = []
                for token in gen:
                    out.append(int(token))
                    if len(out) == spec["output_len"]:
                        break
                outs.append(out)
            rates[name].append(len(spec["prompts"]) * spec["output_len"] / (time.perf_counter() - start))
            tokens[name] = outs
    medians = {k: statistics.median(v) for k, v in rates.items()}
    print(json.dumps({"tok_s": rates, "median_lookup_over_plain": medians["lookup"] / medians["plain"],
                      "same_tokens": tokens["lookup"] == tokens["plain"], "tokens": tokens["plain"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
