"""benchmarks/startup.py: time from starting `dabba serve` to a healthy server."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.startup import time_to_ready


def test_cli_reports_each_runs_time_to_ready() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.startup", "--runs", "2"], capture_output=True, text=True,
                         check=True, timeout=900)
    result = json.loads(out.stdout)
    assert result["model"] == "demo" and len(result["ready_s"]) == 2 and all(s > 0 for s in result["ready_s"])
    assert result["first_s"] == result["ready_s"][0] and result["warm_best_s"] == result["ready_s"][1]


def test_a_server_that_cannot_start_is_an_error_not_a_time(tmp_path) -> None:
    import os

    with pytest.raises(RuntimeError, match="dabba serve exited"):
        time_to_ready(str(tmp_path / "missing"), dict(os.environ), timeout=120)
