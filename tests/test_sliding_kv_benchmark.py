"""benchmarks/sliding_kv.py: the KV memory one 8k-token Gemma-3-1B-shaped sequence holds."""
from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.sliding_kv import SHAPES, run


def test_gemma3_shaped_sequence_holds_a_window_in_sliding_layers() -> None:
    result = run(SHAPES["gemma-3-1b"], context=8192, chunk=512, block_size=16)
    # Decoding its last token (position 8190): the global group holds all 512 blocks; each of the
    # six sliding groups the 33 blocks that keys 8190 - 511 .. 8190 span.
    assert result["decode_blocks"] == 512 + 6 * 33
    assert result["bytes_per_block"] == 16 * 4 * 2 * 256 * 2  # 4 layers x K and V x 1 head of 256, bf16
    assert result["keep_everything_mib"] == 8192 * 26 * 1024 / 2**20
    # the last prefill chunk: 480 global blocks + 6 x (window + chunk) blocks
    assert result["peak_blocks"] == 480 + 6 * 64 + 4 and result["peak_at_token"] == 7680
    assert result["decode_ratio"] < 0.22


def test_cli_prints_json() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.sliding_kv", "--shape", "mistral-7b-v0.1",
                          "--context", "2048", "--chunk", "256"], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result["num_groups"] == 1 and result["sliding_layers"] == 32
    assert result["keep_everything_mib"] == 256.0
