"""Each family's checkpoint as llama.cpp's converter takes it, for the GGUF tests
(tests/test_gguf_models.py against transformers, tests/test_gguf_llamacpp.py against llama.cpp).

What a GGUF file cannot say, llama.cpp (and so dabba) takes as the family's default: the test
checkpoints (tests/conftest.py) that differ from those defaults are made again as the format can
hold them (GGUF_VARIANTS)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.conftest import CHECKPOINTS, INIT_STD, NUM_NEW_TOKENS, Checkpoint, hf_greedy, make_prompts
from tools.tiny_checkpoint import make_checkpoint

REPO = Path(__file__).resolve().parents[1]
LLAMA_CPP = REPO / ".peers" / "llama.cpp"
# Qwen3-MoE: the converter maps no dense MLP in a MoE file (mlp_only_layers). Gemma 2/3: the file
# names no query_pre_attn_scalar (head_dim's), nor Gemma 3's sliding pattern (every sixth layer
# global); Gemma 2's converter drops an untied head and reads its vocabulary as SentencePiece.
GGUF_VARIANTS = {"qwen3moe": dict(mlp_only_layers=[]),
                 "gemma3": dict(num_hidden_layers=7, sliding_window_pattern=6, query_pre_attn_scalar=32),
                 "gemma2": dict(query_pre_attn_scalar=24, tie_word_embeddings=True, sentencepiece="gemma")}


def make_gguf_sources(checkpoints: dict[str, Checkpoint], tmp_path_factory) -> dict[str, Checkpoint]:
    """Each family's source checkpoint and transformers' greedy reference: conftest's, or made
    again with GGUF_VARIANTS."""
    from transformers import AutoModelForCausalLM

    made = dict(checkpoints)
    for family, overrides in GGUF_VARIANTS.items():
        spec = CHECKPOINTS[family] | overrides
        path = make_checkpoint(tmp_path_factory.mktemp(f"{family}-gguf"), spec.pop("arch"), initializer_range=INIT_STD,
                               **spec)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompts = make_prompts(model.config.vocab_size)
        made[family] = Checkpoint(family, path, prompts, hf_greedy(model, prompts, NUM_NEW_TOKENS))
    return made


def converter_view(family: str, checkpoint: Path, directory: Path) -> Path:
    """The checkpoint as the converter can read it. transformers' Qwen2 tokenizer adds Qwen's
    <|endoftext|> to a vocabulary without it, past the tiny checkpoint's vocab_size (the
    converter then refuses it): a view whose pad token is named so. The converter reads Phi-3's
    vocabulary as SentencePiece unless its class is GPT2Tokenizer (Phi-4-mini's): a view that
    says so. The weights and the token ids, so the reference, are the checkpoint's."""
    if not family.startswith(("qwen", "phi3")):
        return checkpoint
    directory.mkdir(parents=True, exist_ok=True)
    for f in checkpoint.iterdir():
        if f.name in ("tokenizer.json", "tokenizer_config.json") and family.startswith("qwen"):
            (directory / f.name).write_text(f.read_text().replace('"<pad>"', '"<|endoftext|>"'))
        elif f.name == "tokenizer_config.json":
            config = json.loads(f.read_text()) | {"tokenizer_class": "GPT2Tokenizer"}
            (directory / f.name).write_text(json.dumps(config))
        else:
            (directory / f.name).symlink_to(f)
    return directory


def make_gguf(source: Path, out_dir: Path, types: list[str], python: str = sys.executable,
              *extra: str) -> dict[str, Path]:
    """benchmarks/peers/make_gguf.py: type -> the file (split: its first shard)."""
    command = [python, str(REPO / "benchmarks" / "peers" / "make_gguf.py"), "--model", str(source), "--llama-cpp-dir",
               str(LLAMA_CPP), "--out-dir", str(out_dir), "--types", ",".join(types), *extra]
    if python != sys.executable:  # the peer venv quantizes; this one (torch, transformers) converts
        command += ["--convert-python", sys.executable]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return {t: Path(p) for t, p in json.loads(result.stdout.splitlines()[-1]).items()}
