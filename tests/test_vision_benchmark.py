"""benchmarks/vision_ttft.py on its tiny shape: both engines read the same prompt, and the JSON
holds what the issue note quotes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("shape", ["tiny", "qwen-tiny"])
def test_vision_ttft_runs_both_engines_on_the_same_prompt(shape, tmp_path) -> None:
    def run(*args: str) -> str:
        return subprocess.run([sys.executable, "-m", "benchmarks.vision_ttft", *args], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout

    run("--make-model", str(tmp_path / "model"), "--shape", shape)
    result = json.loads(run("--model", str(tmp_path / "model"), "--runs", "1", "--threads", "1").splitlines()[-1])
    dabba, theirs = result["dabba"], result["transformers"]
    assert dabba["prompt_tokens"] == theirs["prompt_tokens"] > 64 + 4  # the text and the image's tokens
    assert len(dabba["ttft_s"]) == len(theirs["ttft_s"]) == 1
    assert result["ttft_ratio"] == round(dabba["median_s"] / theirs["median_s"], 3)


def test_vision_mixed_measures_the_streams_alone_and_with_images(tmp_path) -> None:
    from benchmarks.vision_ttft import make_model

    make_model(tmp_path / "model", "tiny")
    out = subprocess.run([sys.executable, "-m", "benchmarks.vision_mixed", "--model", str(tmp_path / "model"),
                          "--streams", "2", "--input-len", "8", "--output-len", "12", "--image-every", "0.05"],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.splitlines()[-1])
    alone, mixed = result["runs"]
    assert not alone["mixed"] and alone["images_arrived"] == 0 and mixed["mixed"] and mixed["images_arrived"] >= 1
    assert result["tpot_ratio"] == round(result["tpot_mixed_ms"] / result["tpot_alone_ms"], 3)
