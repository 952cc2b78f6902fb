"""One workload on llama.cpp (llama-cpp-python's low-level C API), run with the llama.cpp venv's
Python; prints one line of JSON on stdout, logs to stderr.

    python benchmarks/peers/llamacpp_runner.py --gguf FILE --spec SPEC.json

SPEC.json is what benchmarks/compare_peers.py writes: {"kind": "throughput" | "latency",
"prompts": [[ids], ...], "output_len", "shared_prefix_len" (0: none), "threads", "warmup"}, and
optionally "kv_unified" (see below) and "n_ctx" (the KV budget in tokens); the result carries the
n_ctx llama.cpp made (its KV cache holds that many tokens). Token-id prompts, greedy (numpy argmax
over the logits row), EOS ignored: every prompt gets exactly output_len tokens, the first from its
prefill.

- latency (one prompt): TTFT = prefill of the prompt + the first argmax; then output_len - 1 decode
  steps of one token each. decode_tok_s = (output_len - 1) / decode time; e2e = TTFT + decode time.
- throughput (all prompts at once, as llama.cpp's batched / batched-bench examples do): prefill in
  llama_batches of up to n_batch tokens, several sequence ids per batch and logits only for each
  prompt's last token; then every decode step is ONE llama_batch holding one token per sequence
  (seq id i). With shared_prefix_len > 0 the shared prefix is decoded once in sequence 0 and
  copied to the other sequences with llama_memory_seq_cp before the prompts' own tokens are
  prefilled. elapsed_s covers prefill and decode; num_prompt_tokens counts every prompt in full
  (as the other engines count it, shared prefix or not).

One context for the whole run: n_ctx = the spec's, or number of prompts x longest (prompt + output_len),
n_seq_max = number of prompts, n_batch = n_ubatch = 512, n_threads = n_threads_batch = threads,
flash attention and the KV cache type at llama.cpp's defaults. The memory is cleared between the
warm-up and the timed run. kv_unified defaults to (shared_prefix_len > 0): a unified KV buffer lets
the copied prefix cells be shared by every sequence instead of copied into each sequence's own
stream, but every query then scans all cells in use (masked), which made 64 x (256 + 128) about 7x
slower than per-sequence streams (llama-batched-bench's default; its -kvu is the unified mode).
"extra_bufts" (default true) is llama_model_params.use_extra_bufts: llama.cpp's repacked weight
kernels (AVX-512 / AMX). On a 2-core Xeon with AMX (llama-cpp-python 0.3.36) they crash with SIGSEGV
on Q8_0 and Q4_0 models; false runs them on the plain CPU kernels (bf16 there: 5.1 tok/s against
6.2 with them), so ratios against it are upper bounds.
Imports nothing of dabba or torch: stdlib, numpy and llama_cpp only.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import llama_cpp as lc
import numpy as np

N_BATCH = 512
WARMUP_PROMPTS = 4
WARMUP_OUTPUT_LEN = 4


def log(msg: str) -> None:
    print(f"llamacpp_runner: {msg}", file=sys.stderr, flush=True)


@lc.llama_log_callback
def _no_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    pass


class Tok(NamedTuple):
    """One llama_batch entry: token id, position, sequence id, whether to output logits."""
    token: int
    pos: int
    seq: int
    logits: bool


@dataclass
class Engine:
    """A llama.cpp model + context + one reusable llama_batch of n_batch tokens."""
    model: Any
    ctx: Any
    mem: Any
    batch: lc.llama_batch
    n_vocab: int
    n_batch: int

    @classmethod
    def load(cls, gguf: str, n_ctx: int, n_seq: int, threads: int, kv_unified: bool, extra_bufts: bool) -> Engine:
        lc.llama_log_set(_no_log, ctypes.c_void_p(0))
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.use_extra_bufts = extra_bufts
        model = lc.llama_model_load_from_file(gguf.encode(), mparams)
        if not model:
            sys.exit(f"cannot load {gguf}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = N_BATCH
        cparams.n_seq_max = n_seq
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.kv_unified = kv_unified
        cparams.no_perf = True
        ctx = lc.llama_init_from_model(model, cparams)
        if not ctx:
            sys.exit(f"cannot create a context (n_ctx={n_ctx}, n_seq_max={n_seq})")
        n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
        batch = lc.llama_batch_init(N_BATCH, 0, 1)
        return cls(model, ctx, lc.llama_get_memory(ctx), batch, n_vocab, N_BATCH)

    def close(self) -> None:
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def clear(self) -> None:
        lc.llama_memory_clear(self.mem, True)

    def copy_seq(self, src: int, dst: int) -> None:
        lc.llama_memory_seq_cp(self.mem, src, dst, -1, -1)

    def argmax(self, i: int) -> int:
        row = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
        return int(row.argmax())

    def decode(self, toks: list[Tok]) -> dict[int, int]:
        """llama_decode `toks` in chunks of n_batch; returns {seq: greedy next token} for each
        entry that asked for logits."""
        out: dict[int, int] = {}
        for start in range(0, len(toks), self.n_batch):
            chunk = toks[start:start + self.n_batch]
            self._fill(chunk)
            rc = lc.llama_decode(self.ctx, self.batch)
            if rc != 0:
                sys.exit(f"llama_decode returned {rc} (batch of {len(chunk)} tokens)")
            for i, t in enumerate(chunk):
                if t.logits:
                    out[t.seq] = self.argmax(i)
        return out

    def _fill(self, chunk: list[Tok]) -> None:
        b = self.batch
        for i, t in enumerate(chunk):
            b.token[i] = t.token
            b.pos[i] = t.pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = t.seq
            b.logits[i] = t.logits
        b.n_tokens = len(chunk)


def prompt_toks(prompt: list[int], seq: int, start: int = 0) -> list[Tok]:
    """Tokens prompt[start:] of sequence `seq`, logits for the last one only."""
    last = len(prompt) - 1
    return [Tok(prompt[pos], pos, seq, pos == last) for pos in range(start, len(prompt))]


def generate_one(engine: Engine, prompt: list[int], output_len: int) -> tuple[float, float, list[int]]:
    """(ttft_s, decode_s, generated ids) for one prompt, from an empty memory."""
    engine.clear()
    start = time.perf_counter()
    tok = engine.decode(prompt_toks(prompt, 0))[0]
    ttft = time.perf_counter() - start
    out = [tok]
    start = time.perf_counter()
    for pos in range(len(prompt), len(prompt) + output_len - 1):
        tok = engine.decode([Tok(tok, pos, 0, True)])[0]
        out.append(tok)
    return ttft, time.perf_counter() - start, out


def prefill_batch(engine: Engine, prompts: list[list[int]], shared_prefix_len: int) -> dict[int, int]:
    """Prefill every prompt in its own sequence; the shared prefix once, then copied."""
    start = 0
    if shared_prefix_len > 0:
        engine.decode([Tok(t, pos, 0, False) for pos, t in enumerate(prompts[0][:shared_prefix_len])])
        for seq in range(1, len(prompts)):
            engine.copy_seq(0, seq)
        start = shared_prefix_len
    return engine.decode([t for seq, p in enumerate(prompts) for t in prompt_toks(p, seq, start)])


def generate_batch(engine: Engine, prompts: list[list[int]], output_len: int,
                   shared_prefix_len: int) -> tuple[float, list[list[int]]]:
    """Greedy output_len tokens for every prompt, all sequences together, from an empty memory;
    returns (prefill seconds, generated ids per prompt)."""
    engine.clear()
    start = time.perf_counter()
    first = prefill_batch(engine, prompts, shared_prefix_len)
    prefill_s = time.perf_counter() - start
    outs = [[first[seq]] for seq in range(len(prompts))]
    for step in range(output_len - 1):
        nxt = engine.decode([Tok(out[-1], len(p) + step, seq, True)
                             for seq, (p, out) in enumerate(zip(prompts, outs))])
        for seq, out in enumerate(outs):
            out.append(nxt[seq])
    return prefill_s, outs


def run_latency(engine: Engine, spec: dict[str, Any]) -> dict[str, Any]:
    (prompt,) = spec["prompts"]
    output_len = spec["output_len"]
    if spec["warmup"]:
        _, _, warm = generate_one(engine, prompt, output_len)
    ttft, decode_s, out = generate_one(engine, prompt, output_len)
    log(f"first generated ids: {out[:8]}")
    if spec["warmup"]:
        log(f"greedy ids identical across warm-up and timed run: {warm == out}")
    return {"ttft_s": ttft, "decode_tok_s": (output_len - 1) / decode_s if output_len > 1 else None,
            "e2e_s": ttft + decode_s, "num_output_tokens": len(out)}


def run_throughput(engine: Engine, spec: dict[str, Any], shared_prefix_len: int) -> dict[str, Any]:
    prompts, output_len = spec["prompts"], spec["output_len"]
    if spec["warmup"]:
        generate_batch(engine, prompts[:WARMUP_PROMPTS], min(output_len, WARMUP_OUTPUT_LEN), shared_prefix_len)
    start = time.perf_counter()
    prefill_s, outs = generate_batch(engine, prompts, output_len, shared_prefix_len)
    elapsed = time.perf_counter() - start
    log(f"first generated ids of sequences 0 and 1: {outs[0][:8]} {outs[1][:8] if len(outs) > 1 else []}")
    num_prompt = sum(len(p) for p in prompts)
    num_out = sum(len(o) for o in outs)
    return {"elapsed_s": elapsed, "num_prompt_tokens": num_prompt, "num_output_tokens": num_out,
            "total_tok_s": (num_prompt + num_out) / elapsed, "output_tok_s": num_out / elapsed,
            "prefill_s": prefill_s}


def checked_shared_prefix_len(prompts: list[list[int]], n: int) -> int:
    """The spec's shared_prefix_len, verified; capped so every prompt keeps one token of its own
    (its prefill then yields the logits of its last token)."""
    n = min(n, min(len(p) for p in prompts) - 1)
    if n > 0 and any(p[:n] != prompts[0][:n] for p in prompts):
        sys.exit(f"the prompts do not share their first {n} tokens")
    return max(n, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    prompts, kind = spec["prompts"], spec["kind"]
    if kind == "latency" and len(prompts) != 1:
        sys.exit("a latency spec has exactly one prompt")
    if spec["output_len"] < 1:
        sys.exit("output_len must be >= 1")

    if kind not in ("latency", "throughput"):
        sys.exit(f"unknown kind {kind!r}")
    shared = checked_shared_prefix_len(prompts, int(spec.get("shared_prefix_len", 0)))

    need = len(prompts) * max(len(p) + spec["output_len"] for p in prompts)
    n_ctx = int(spec.get("n_ctx") or need)
    if n_ctx < need:
        sys.exit(f"n_ctx {n_ctx} cannot hold {len(prompts)} sequences of the longest prompt + output ({need} tokens)")
    kv_unified = bool(spec.get("kv_unified", shared > 0))
    extra_bufts = bool(spec.get("extra_bufts", True))
    engine = Engine.load(args.gguf, n_ctx, len(prompts), int(spec.get("threads", 2)), kv_unified, extra_bufts)
    log(f"{args.gguf}: {kind}, {len(prompts)} prompts, shared prefix {shared}, n_ctx {n_ctx}, "
        f"kv_unified {kv_unified}, extra_bufts {extra_bufts}")
    try:
        result = run_latency(engine, spec) if kind == "latency" else run_throughput(engine, spec, shared)
        result["n_ctx"] = lc.llama_n_ctx(engine.ctx)
    finally:
        engine.close()
    print(json.dumps({"engine": "llama.cpp", **result}), flush=True)


if __name__ == "__main__":
    main()
