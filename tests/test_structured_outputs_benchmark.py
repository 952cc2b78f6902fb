"""benchmarks/structured_outputs.py runs end to end and reports what it says it does."""
from __future__ import annotations

import json
import subprocess
import sys

from dabba.config import DEMO_MODEL


def test_cli_reports_decode_rates_and_first_request_latency() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.structured_outputs", "--model", DEMO_MODEL,
                          "--batch-sizes", "1", "3", "--output-len", "12", "--repeats", "1", "--dtype", "float32"],
                         capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    for batch in (1, 3):
        rates = result[f"batch_{batch}"]["decode_tokens_per_s"]
        assert rates["plain"] > 0 and rates["json_schema"] > 0
        assert result[f"batch_{batch}"]["slowdown"] == 1 - rates["json_schema"] / rates["plain"]
    assert set(result["first_request_s"]) == {"plain", "schema_first_in_process", "schema_cold", "schema_cached"}
    assert all(v > 0 for v in result["first_request_s"].values())
