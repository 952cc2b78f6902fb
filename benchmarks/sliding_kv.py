"""KV memory one sequence holds at a long context when sliding-window layers free the blocks their
window has passed (KV-cache groups, dabba/core/kv_cache_groups.py), against a cache that keeps
every layer's whole context. Prints JSON.

    python -m benchmarks.sliding_kv [--shape gemma-3-1b | --model DIR] [--context 8192] [--chunk 2048]

The sequence runs through the engine's own Scheduler and KVCacheManager (a prompt of
context - 64 tokens prefilled in chunks, then 64 decodes); only the model is left out, since
what a sequence holds is the manager's decision (tests/test_sliding_window_kv.py checks the
engine holds the same with a model). Peak bytes = the most blocks held at once x the bytes of
a pool block (one block of each layer position of a group); it comes during the last prefill
chunk, when a sliding group holds the window plus the chunk. decode_* is what the sequence holds
while decoding at the full context.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from dabba.config import SchedulerConfig
from dabba.core.kv_cache_groups import group_layers, group_size
from dabba.core.kv_cache_manager import KVCacheManager
from dabba.core.outputs import ModelRunnerOutput
from dabba.core.request import Request
from dabba.core.scheduler import Scheduler
from dabba.sampling_params import SamplingParams

NUM_OUTPUT = 64


@dataclass(frozen=True)
class KVShape:
    layer_windows: tuple[int | None, ...]
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bf16

    @property
    def bytes_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes


SHAPES = {
    # 26 layers, every 6th global, window 512, 1 KV head of 256 (google/gemma-3-1b-it's config)
    "gemma-3-1b": KVShape(tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26)), 1, 256),
    # 26 layers alternating sliding (4096) and global, 4 KV heads of 256 (google/gemma-2-2b-it)
    "gemma-2-2b": KVShape(tuple(4096 if i % 2 == 0 else None for i in range(26)), 4, 256),
    # 32 layers, all sliding (4096), 8 KV heads of 128 (mistralai/Mistral-7B-v0.1)
    "mistral-7b-v0.1": KVShape((4096,) * 32, 8, 128),
}


def shape_of_model(model_dir: str) -> KVShape:
    from dabba.arch.config import ArchConfig

    arch = ArchConfig.from_hf(model_dir)
    return KVShape(tuple(arch.layer_sliding_window(i) for i in range(arch.num_hidden_layers)),
                   arch.num_key_value_heads, arch.head_dim)


def run(shape: KVShape, context: int, chunk: int, block_size: int) -> dict[str, Any]:
    groups = group_layers(shape.layer_windows)
    block_bytes = block_size * group_size(groups) * shape.bytes_per_token_per_layer
    kv = KVCacheManager(context * len(groups), block_size, groups=groups, max_chunk=chunk)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=chunk), kv, context + 1)
    request = Request("seq", list(range(context - NUM_OUTPUT)),
                      SamplingParams(max_tokens=NUM_OUTPUT, temperature=0, ignore_eos=True), block_size=block_size)
    scheduler.add_request(request)
    peak_blocks = peak_at = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        held = sum(1 for table in kv.get_block_ids("seq") for b in table if b != kv.pool.null_block.block_id) \
            if kv.pool.null_block is not None else sum(map(len, kv.get_block_ids("seq")))
        decode_blocks = held  # ends as what the last decode step holds
        if held > peak_blocks:
            peak_blocks, peak_at = held, request.num_computed_tokens
        done = request.num_computed_tokens + out.num_scheduled_tokens["seq"] == request.num_tokens
        scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"seq": [7]} if done else {}))
        kv.check_integrity()
    grouped = peak_blocks * block_bytes
    keep_all = context * len(shape.layer_windows) * shape.bytes_per_token_per_layer
    return {
        "context": context, "chunk": chunk, "block_size": block_size,
        "num_layers": len(shape.layer_windows),
        "sliding_layers": sum(w is not None for w in shape.layer_windows),
        "num_groups": len(groups), "group_size": group_size(groups), "bytes_per_block": block_bytes,
        "peak_blocks": peak_blocks, "peak_at_token": peak_at,
        "grouped_mib": round(grouped / 2**20, 2), "keep_everything_mib": round(keep_all / 2**20, 2),
        "ratio": round(grouped / keep_all, 4),
        # decoding at the full context: the window alone in sliding groups, no prefill chunk on top
        "decode_blocks": decode_blocks, "decode_mib": round(decode_blocks * block_bytes / 2**20, 2),
        "decode_ratio": round(decode_blocks * block_bytes / keep_all, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--shape", choices=sorted(SHAPES), default="gemma-3-1b")
    source.add_argument("--model", help="a model directory: its config.json's layers, windows and KV heads")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    shape = shape_of_model(args.model) if args.model else SHAPES[args.shape]
    result = run(shape, args.context, args.chunk, args.block_size)
    print(json.dumps({"model": args.model or args.shape, **result}))


if __name__ == "__main__":
    main()
