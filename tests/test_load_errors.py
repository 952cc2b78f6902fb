"""A broken or unfitting checkpoint is refused with one clear error: a ValueError naming the file
(or the sizes) from `LLM`, one line and exit status 2 from the CLI, a traceback only with
--log-level debug. Nothing is allocated for a model that cannot fit."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dabba import LLM
from dabba.entrypoints.cli import main
from tests.test_loading import copy_checkpoint, edit_config


def truncate(file: Path, keep: float) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def break_header(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[8:16] = b"\x00garbage"  # the JSON header's first bytes
    file.write_bytes(bytes(data))


def drop_a_shard(path: Path) -> str:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (path / shard).unlink()
    return shard


def _drop(path: Path, key: str) -> None:
    cfg = json.loads((path / "config.json").read_text())
    del cfg[key]
    (path / "config.json").write_text(json.dumps(cfg))


def too_big(path: Path) -> None:  # about 3.5 TiB of bf16 weights
    edit_config(path, hidden_size=16384, intermediate_size=65536, num_hidden_layers=1000, num_attention_heads=128,
                num_key_value_heads=8, head_dim=128, torch_dtype="bfloat16")


BROKEN = {
    # name: (checkpoint, how to break it, what the message must say)
    "truncated weights": ("llama", lambda p: truncate(p / "model.safetensors", 0.5),
                          r"model\.safetensors is not a readable safetensors file"),
    "corrupt header": ("llama", lambda p: break_header(p / "model.safetensors"),
                       r"model\.safetensors is not a readable safetensors file"),
    "empty weights file": ("llama", lambda p: (p / "model.safetensors").write_bytes(b""),
                           r"model\.safetensors is not a readable safetensors file"),
    "malformed config": ("llama", lambda p: (p / "config.json").write_text('{"architectures": ["LlamaForCausalLM"'),
                         r"config\.json is not valid JSON"),
    "config not an object": ("llama", lambda p: (p / "config.json").write_text("[1, 2]"),
                             r"config\.json must hold a JSON object"),
    "config missing a size": ("llama", lambda p: _drop(p, "hidden_size"), r"config\.json has no 'hidden_size'"),
    "config with a string size": ("llama", lambda p: edit_config(p, num_hidden_layers="two"),
                                  r"config\.json has a field of the wrong type"),
    "malformed generation config": ("llama", lambda p: (p / "generation_config.json").write_text("{"),
                                    r"generation_config\.json is not valid JSON"),
    "malformed tokenizer": ("llama", lambda p: (p / "tokenizer.json").write_text('{"model": 5}'),
                            r"tokenizer\.json is not a tokenizer"),
    "missing shard": ("mistral", drop_a_shard, r"index\.json names shards that are not there"),
    "malformed index": ("mistral", lambda p: (p / "model.safetensors.index.json").write_text('{"weight_map": 3}'),
                        r"index\.json has no weight_map"),
    "weights that cannot fit": ("llama", too_big, r"the weights of .* GiB needed, but only .* GiB of memory is available"),
}


@pytest.fixture(params=sorted(BROKEN))
def broken(request, checkpoints, tmp_path):
    family, damage, message = BROKEN[request.param]
    path = copy_checkpoint(checkpoints[family].path, tmp_path / "ck")
    damage(path)
    return path, message


def test_llm_raises_a_value_error_naming_the_problem(broken) -> None:
    path, message = broken
    with pytest.raises(ValueError, match=message):
        LLM(str(path), dtype="float32", kv_cache_memory=2**20)


def test_the_cli_prints_one_line_and_exits_2(broken, capsys) -> None:
    path, message = broken
    assert main(["generate", str(path), "--prompt", "x", "--kv-cache-memory", "1MiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and err[-1].startswith("error: ")
    assert not any("Traceback" in line for line in err)
    assert re.search(message, err[-1])


def test_a_kv_cache_that_cannot_fit_is_refused_before_it_is_allocated(checkpoints) -> None:
    with pytest.raises(ValueError, match=r"the KV cache \(kv_cache_memory\): 1024\.00 GiB needed"):
        LLM(str(checkpoints["llama"].path), dtype="float32", kv_cache_memory=2**40)


def test_debug_logging_adds_the_traceback(checkpoints, tmp_path) -> None:
    path = copy_checkpoint(checkpoints["llama"].path, tmp_path / "ck")
    (path / "config.json").write_text("{")
    base = [sys.executable, "-m", "dabba.entrypoints.cli", "plan", str(path)]
    quiet = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr
    assert quiet.stderr.strip().splitlines()[-1].startswith("error: ") and "config.json" in quiet.stderr
    loud = subprocess.run(base + ["--log-level", "debug"], capture_output=True, text=True, timeout=300)
    assert loud.returncode == 2 and "Traceback" in loud.stderr
