"""benchmarks/lora.py on the tiny Llama: it writes adapters in PEFT's layout that dabba reads, runs
the base model, the base with enable_lora and the adapters in one run, and reports each."""
from __future__ import annotations

import json

from benchmarks import lora


def test_lora_benchmark_reports_each_run(checkpoints, tmp_path, capsys) -> None:
    lora.main(["--model", str(checkpoints["llama"].path), "--num-prompts", "6", "--input-len", "20",
               "--output-len", "4", "--num-adapters", "2", "--rank", "4", "--dtype", "float32",
               "--adapter-dir", str(tmp_path)])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for run in ("base", "base_enable_lora", "adapters"):
        assert result[run]["num_output_tokens"] == 6 * 4 and result[run]["total_tokens_per_s"] > 0
    assert "enable_lora" in result["adapters"]["layer_loop"]
    assert result["adapters_vs_base"] > 0
    assert len(list(tmp_path.iterdir())) == 2  # the adapters it wrote
