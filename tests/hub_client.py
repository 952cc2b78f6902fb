"""Runs jobs against a model given as a Hub repo id, in a process of its own: huggingface_hub reads
HF_ENDPOINT and HF_HUB_OFFLINE when it is imported, so each test environment needs a fresh
interpreter. One JSON line per job: the greedy token ids and the directory the model was read
from, or the ValueError's message.

    python -m tests.hub_client '[{"model": "acme/tiny", "options": {...}, "env": {...}, "prompt": [1, 2]}]'
"""
from __future__ import annotations

import json
import os
import sys


def main() -> None:
    from dabba import LLM, SamplingParams

    for job in json.loads(sys.argv[1]):
        os.environ.update(job.get("env", {}))  # read per call by huggingface_hub (HF_TOKEN)
        try:
            llm = LLM(job["model"], dtype="float32", kv_cache_memory=2**22, **job.get("options", {}))
            out = llm.generate({"prompt_token_ids": job["prompt"]}, SamplingParams(temperature=0, max_tokens=8,
                                                                                   ignore_eos=True), use_tqdm=False)
            result = {"token_ids": out[0].outputs[0].token_ids,
                      "tokenizer_vocab": llm.get_tokenizer().hf_tokenizer.get_vocab_size()}
        except ValueError as e:
            result = {"error": str(e)}
        for name in job.get("env", {}):
            del os.environ[name]
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
