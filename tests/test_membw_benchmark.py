"""benchmarks/membw.py: the read bandwidth it measures and the decode share it derives."""
from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.membw import read_bandwidth, weight_bytes
from dabba.config import DEMO_MODEL


def test_read_bandwidth_is_bytes_over_time() -> None:
    rates = read_bandwidth(64 * 2**20, 3)
    assert len(rates) == 3 and all(r > 0 for r in rates)


def test_weight_bytes_counts_the_checkpoint(checkpoints) -> None:
    from safetensors.torch import load_file

    path = checkpoints["llama"].path
    tensors = load_file(path / "model.safetensors")
    assert weight_bytes(str(path)) == sum(t.numel() * t.element_size() for t in tensors.values())


def test_cli_reports_the_decode_share() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.membw", "--gib", "0.0625", "--iters", "2",
                          "--model", DEMO_MODEL, "--decode-tok-s", "10"], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result["decode_gb_s"] == weight_bytes(DEMO_MODEL) * 10 / 1e9
    assert result["share_of_best"] == result["decode_gb_s"] / result["read_gb_s_best"]
