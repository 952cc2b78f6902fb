"""llama.cpp's greedy tokens and log-probabilities on a GGUF file: the reference for dabba's reading
of quantized files (tests/test_gguf_llamacpp.py). Runs in the peer venv .venv-llamacpp/
(scripts/peer-llamacpp.sh), through llama-cpp-python's low-level API; imports nothing of dabba.

    python tests/peer_llamacpp.py --gguf FILE --prompts PROMPTS.json --new 32 --out OUT.json

PROMPTS.json: a list of token-id lists. OUT.json: per prompt, per generated position, the greedy
token, its log-probability and the runner-up's (float64 log-softmax of llama.cpp's logits), with
a float32 KV cache, as dabba's under dtype float32.
llama.cpp's repacked CPU weight kernels (extra buffer types) are off: they crash on some CPUs with
AMX, and they compute what the plain kernels do. Its flash attention is off too: on the CPU it
rounds inside to float16 (outputs 5e-4 from float32's attention on these files), which every
8-bit activation rounding downstream then amplifies (a code moved by one is 1/127 of its block).
Without it, layer by layer, llama.cpp's and dabba's outputs on a quantized file agree to float32
summation order until such a rounding falls on a near-half.
"""
from __future__ import annotations

import argparse
import ctypes
import json

import llama_cpp as lc
import numpy as np


@lc.llama_log_callback
def _no_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    prompts = json.loads(open(args.prompts).read())

    lc.llama_log_set(_no_log, ctypes.c_void_p(0))
    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = 0
    mparams.use_extra_bufts = False
    model = lc.llama_model_load_from_file(args.gguf.encode(), mparams)
    assert model, f"cannot load {args.gguf}"
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = max(len(p) for p in prompts) + args.new + 16
    cparams.n_batch = cparams.n_ubatch = cparams.n_ctx
    cparams.n_threads = cparams.n_threads_batch = 2
    cparams.no_perf = True
    cparams.type_k = cparams.type_v = lc.GGML_TYPE_F32  # as dabba's float32 cache (llama.cpp's default: f16)
    cparams.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED  # float32 attention (see the docstring)
    ctx = lc.llama_init_from_model(model, cparams)
    assert ctx, "cannot create a context"
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    memory = lc.llama_get_memory(ctx)
    batch = lc.llama_batch_init(cparams.n_ctx, 0, 1)

    def decode(tokens: list[int], start: int) -> np.ndarray:
        """The tokens at positions start.., the last one's log-softmax."""
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, start + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(tokens) - 1
        batch.n_tokens = len(tokens)
        assert lc.llama_decode(ctx, batch) == 0, "llama_decode failed"
        row = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, len(tokens) - 1), shape=(n_vocab,)).astype(np.float64)
        return row - (np.log(np.exp(row - row.max()).sum()) + row.max())

    results = []
    for prompt in prompts:
        lc.llama_memory_clear(memory, True)
        logprobs = decode(prompt, 0)
        steps = []
        for i in range(args.new):
            order = np.argsort(-logprobs, kind="stable")[:2]
            steps.append({"token": int(order[0]), "logprob": float(logprobs[order[0]]),
                          "runner_up": float(logprobs[order[1]])})
            logprobs = decode([int(order[0])], len(prompt) + i)
        results.append(steps)
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    open(args.out, "w").write(json.dumps(results))


if __name__ == "__main__":
    main()
