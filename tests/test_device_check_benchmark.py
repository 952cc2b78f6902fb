"""benchmarks/device_check.py, the script a session lent a GPU runs, on the CPU: its parity figures
count agreement correctly, and a family that matches transformers reports so."""
from __future__ import annotations

import json

from benchmarks.device_check import agreement, main


def test_agreement_counts_equal_runs_and_the_prefix_before_each_difference() -> None:
    assert agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 9, 7, 8]]) == {
        "equal": 1, "of": 2, "tokens_before_first_difference": 5 / 8}


def test_a_family_on_the_cpu_equals_transformers(tmp_path, capsys) -> None:
    assert main(["--device", "cpu", "--families", "qwen2", "--shape", "", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "device_check.json").read_text())
    assert json.loads(capsys.readouterr().out) == result
    qwen2 = result["parity"]["qwen2"]
    assert qwen2["whole"] == qwen2["chunked_prefix_cached"] == {"equal": 12, "of": 12,
                                                                "tokens_before_first_difference": 1.0}
    assert qwen2["max_logprob_difference"] < 1e-4
    assert qwen2["prefix_hit_tokens"] >= 2 * 144  # the two prompts sharing a 150-token prefix
