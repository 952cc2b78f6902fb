"""The memory one decode step actually touches, measured by the kernel's page-table accessed bits,
against the weight bytes it should read: for a mixture of experts, the experts the tokens took
(issue 20: within 1.3x of the active experts' bytes), not the whole layer's.

    python -m benchmarks.bytes_touched --model DIR [--quantization int4] [--batch 1] [--steps 8]

Linux's /proc/self/clear_refs clears the accessed bit of every page the process maps; after one
engine step, /proc/self/smaps_rollup's Referenced counts the pages that step touched: weights,
KV cache, activations, the interpreter's own. That is an upper bound on the bytes read (a touched
page counts whole), taken from the hardware, not from what the code intends to read; these VMs
expose no memory-traffic counters. Transparent huge pages are turned off for the process first
(prctl PR_SET_THP_DISABLE): with them a decode step's few KV-cache blocks, one per kv head and
layer, each counted a 2 MiB page (510 MiB of Referenced for Llama-3.2-1B's 16 layers x 8 heads
x K and V), where 4 KiB pages count about what is read. Each measured step decodes one token
for each of ``batch`` requests after their prompts were prefilled; the report gives each step's
touched MiB, their median, and the ratios to dabba's packed weight bytes: those one token's
forward multiplies (``active``: a routed layer counts top_k experts, the embedding one row) and all
of them. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import re
import statistics
import sys
from pathlib import Path

import torch

from benchmarks.peers.bandwidth import decode_bytes_per_token
from dabba import LLM, SamplingParams
from dabba.arch.config import ArchConfig
from dabba.models.sizes import weights_bytes
from dabba.quantization.config import QuantConfig

CLEAR_REFS = Path("/proc/self/clear_refs")
PR_SET_THP_DISABLE = 41
ROLLUP = Path("/proc/self/smaps_rollup")


def disable_huge_pages() -> None:
    """prctl(PR_SET_THP_DISABLE, 1): this process's later mappings use 4 KiB pages."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_THP_DISABLE) failed")


def referenced_bytes() -> int:
    """Bytes of this process's pages whose accessed bit is set."""
    m = re.search(r"^Referenced:\s+(\d+) kB", ROLLUP.read_text(), re.MULTILINE)
    if m is None:
        raise RuntimeError(f"{ROLLUP} has no Referenced line")
    return int(m.group(1)) * 1024


def touched_by(fn) -> int:  # type: ignore[no-untyped-def]
    """Bytes of pages fn() touched (accessed bits cleared before, counted after). Python's cyclic
    garbage collector is held off meanwhile: a collection walks every tracked object, touching
    megabytes of heap that fn() never reads (a 64 MiB read once counted 77 MB)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        CLEAR_REFS.write_text("1")
        fn()
        return referenced_bytes()
    finally:
        if enabled:
            gc.enable()


def expected_bytes(model_dir: str, quantization: str | None) -> dict[str, int]:
    """dabba's packed weight bytes: all, and those one token's forward reads (compare_peers'
    bandwidth report counts the same: benchmarks/peers/bandwidth.py)."""
    quant = QuantConfig(quantization) if quantization else None
    return {"all_weights": weights_bytes(ArchConfig.from_hf(model_dir), torch.bfloat16, quant),
            "active_weights": decode_bytes_per_token(model_dir, quantization or "bf16")}


def measure(model_dir: str, quantization: str | None, batch: int, steps: int, prompt_len: int) -> dict:
    llm = LLM(model_dir, dtype="bfloat16", quantization=quantization, max_num_seqs=max(batch, 1),
              enable_prefix_caching=False)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    vocab = ArchConfig.from_hf(model_dir).vocab_size
    for i in range(batch):
        ids = [(7 + 13 * i + 31 * j) % (vocab - 3) + 3 for j in range(prompt_len)]
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
    while engine.get_stats().num_waiting_reqs or any(  # until every prompt is in and one token out
            len(r.output_token_ids) == 0 for r in engine.engine_core.scheduler.running):
        engine.step()
    engine.step()  # one decode step first: anything lazily allocated on the first is in place
    touched = [touched_by(engine.step) for _ in range(steps)]
    expected = expected_bytes(model_dir, quantization)
    median = statistics.median(touched)
    return {"model": model_dir, "quantization": quantization or "bf16", "batch": batch, "steps": steps,
            "layer_loop": "native" if engine.engine_core.model_runner.native_loop is not None else "python",
            "touched_mib_per_step": [round(t / 2**20, 1) for t in touched], "touched_mib_median": median / 2**20,
            "active_weights_mib": expected["active_weights"] / 2**20,
            "all_weights_mib": expected["all_weights"] / 2**20,
            "touched_over_active": median / expected["active_weights"],
            "touched_over_all": median / expected["all_weights"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--quantization", choices=["int8", "int4"], default=None)
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together (default 1)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps measured, one at a time (default 8)")
    parser.add_argument("--prompt-len", type=int, default=32)
    args = parser.parse_args(argv)
    if not CLEAR_REFS.exists():
        print(json.dumps({"error": "/proc/self/clear_refs is missing: not Linux, or not permitted"}))
        return 1
    disable_huge_pages()
    print(json.dumps(measure(args.model, args.quantization, args.batch, args.steps, args.prompt_len)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
