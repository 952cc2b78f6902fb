"""benchmarks/cold_start.py on the tiny Llama: the plan's predicted load, a server of several
models started with the model unloaded, its cold and warm first tokens, in one JSON object."""
from __future__ import annotations

import json

from benchmarks import cold_start


def test_cold_start_benchmark_reports_the_prediction_and_the_cold_first_token(checkpoints, capsys) -> None:
    cold_start.main(["--model", str(checkpoints["llama"].path), "--input-len", "16", "--kv-cache-memory", "4MiB",
                     "--dtype", "float32"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["predicted_load_s"] > 0 and result["server_load_s"] > 0
    assert result["cold_ttft_s"] >= result["server_load_s"]  # the first token waited for the load
    assert result["kv_cache_bytes"] <= 4 * 2**20 and isinstance(result["within_prediction"], bool)
