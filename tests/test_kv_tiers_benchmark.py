"""benchmarks/kv_tiers.py on the tiny Llama: a recompute, then a restarted engine that reads the
prompt's prefix from the disk tier, each in its own process, in one JSON object."""
from __future__ import annotations

import json

from benchmarks import kv_tiers


def test_kv_tiers_benchmark_restarts_over_the_disk_tier(checkpoints, capsys) -> None:
    kv_tiers.main(["--model", str(checkpoints["llama"].path), "--prompt-len", "100", "--kv-memory", "4MiB",
                   "--dtype", "float32"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["recompute"]["cached_tokens"] == 0 and result["recompute"]["disk_bytes"] > 0
    assert result["restart_from_disk"]["cached_tokens"] == 96  # every full block before the last token
    assert result["restart_from_disk"]["disk_hit_blocks"] == 6 and result["ttft_ratio"] > 0
