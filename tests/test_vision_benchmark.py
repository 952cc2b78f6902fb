"""benchmarks/vision_ttft.py on its tiny shape: both engines read the same prompt, and the JSON
holds what the issue note quotes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_vision_ttft_runs_both_engines_on_the_same_prompt(tmp_path) -> None:
    def run(*args: str) -> str:
        return subprocess.run([sys.executable, "-m", "benchmarks.vision_ttft", *args], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout

    run("--make-model", str(tmp_path / "model"), "--shape", "tiny")
    result = json.loads(run("--model", str(tmp_path / "model"), "--runs", "1", "--threads", "1").splitlines()[-1])
    dabba, theirs = result["dabba"], result["transformers"]
    assert dabba["prompt_tokens"] == theirs["prompt_tokens"] > 64 + 4  # the text and the image's tokens
    assert len(dabba["ttft_s"]) == len(theirs["ttft_s"]) == 1
    assert result["ttft_ratio"] == round(dabba["median_s"] / theirs["median_s"], 3)
