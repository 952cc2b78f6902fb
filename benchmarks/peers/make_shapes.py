"""Make the random bf16 checkpoints that benchmarks/compare_peers.py measures across model shapes,
and their GGUF files (bf16, q8_0, q4_0; the mixture of experts: bf16, q4_0) for the llama.cpp peer.

    .venv/bin/python -m benchmarks.peers.make_shapes [--out /tmp/shapes] [--shapes NAME,...] \\
        [--llamacpp-python /tmp/peers/llamacpp/bin/python] [--llama-cpp-dir SRC] [--no-gguf]

Writes OUT/<name>/ (config.json, model.safetensors, a tokenizer) and OUT/<name>/gguf/model-{bf16,
q8_0,q4_0}.gguf, the layout compare_peers expects by default, and prints one JSON dict {name: dir}.
A checkpoint whose config.json already has the shape is kept; make_gguf.py keeps existing GGUFs.

Reproducible: the weights are transformers' random init at seed 0 (tools.tiny_checkpoint), the
tokenizer a byte-level BPE that tools.tiny_checkpoint trains on the standard library's source with
the shape's real vocabulary size as its target (the trainer stops where the corpus runs out of
merges; make_gguf.py pads the rest for llama.cpp). Real configs' numbers, random weights: the
figures measure the engines, not the model. No download.

Run it with dabba's venv (transformers, torch); the GGUF step runs make_gguf.py under the llama.cpp
venv's Python, which has llama-cpp-python and the converter's torch + transformers
(scripts/peers-bench.sh makes it).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PEERS_DIR = Path(__file__).resolve().parent
LLAMA_CPP_SRC = "/tmp/peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp"


@dataclass(frozen=True)
class Shape:
    """One model shape: its architecture and the config.json numbers of the real model."""
    name: str
    arch: str
    config: dict[str, Any] = field(default_factory=dict)
    # the GGUF types made for llama.cpp (a 7B-parameter MoE's bf16 and q4_0 files alone take 18 GB)
    gguf_types: tuple[str, ...] = ("bf16", "q8_0", "q4_0")
    default: bool = True  # made without --shapes: issue 17's three shapes


SHAPES = {s.name: s for s in (
    Shape("smollm2-135m", "LlamaForCausalLM", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    Shape("qwen2.5-0.5b", "Qwen2ForCausalLM", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        gguf_types=("bf16", "q8_0", "q4_0", "q4_k_m")),
    Shape("llama-3.2-1b", "LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    # issue 41's: TinyLlama-1.1B (GQA 8:1, untied 32k vocabulary), GGUF in the usual presets
    Shape("tinyllama-1.1b", "LlamaForCausalLM", dict(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-5,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        gguf_types=("bf16", "q8_0", "q4_0", "q4_k_m"), default=False),
    # a mixture of experts (issue 20): 64 experts of 1024, 8 per token; 6.9 B parameters, 1.3 B active
    Shape("olmoe-1b-7b", "OlmoeForCausalLM", dict(
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, clip_qkv=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), gguf_types=("bf16", "q4_0"), default=False),
    # issue 15's two: Gemma 3 1B (head_dim 256, one KV head, 5 of 6 layers sliding within 512 keys
    # with their own RoPE base, 262k vocabulary, tied) and Qwen2.5-1.5B (q/k/v biases, GQA 6:1)
    Shape("gemma-3-1b", "Gemma3ForCausalLM", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, max_position_embeddings=32768,
        rms_norm_eps=1e-6, sliding_window=512, sliding_window_pattern=6, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}), default=False),
    Shape("qwen2.5-1.5b", "Qwen2ForCausalLM", dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), default=False),
)}


def log(msg: str) -> None:
    print(f"make_shapes: {msg}", file=sys.stderr, flush=True)


def has_shape(model_dir: Path, shape: Shape) -> bool:
    """Whether ``model_dir`` already holds a checkpoint of ``shape`` (its config.json and weights)."""
    cfg_path = model_dir / "config.json"
    files = cfg_path.is_file() and (model_dir / "tokenizer.json").is_file() and any(model_dir.glob("*.safetensors"))
    if not files:
        return False
    cfg = json.loads(cfg_path.read_text())
    return cfg.get("architectures") == [shape.arch] and all(
        cfg.get(k) == v for k, v in shape.config.items() if k != "rope_parameters")


def make_checkpoint(shape: Shape, model_dir: Path) -> None:
    from tools.tiny_checkpoint import make_checkpoint as make

    vocab = shape.config["vocab_size"]
    log(f"{shape.name}: training a {vocab}-token tokenizer and writing random bf16 weights to {model_dir}")
    make(model_dir, shape.arch, seed=0, dtype="bfloat16", tokenizer_vocab_size=vocab, tokenizer_corpus="stdlib",
         **shape.config)


def make_ggufs(shape: Shape, model_dir: Path, llamacpp_python: str, llama_cpp_dir: str) -> dict[str, str]:
    """make_gguf.py under the llama.cpp venv: model_dir/gguf/model-{type}.gguf for the shape's types."""
    cmd = [llamacpp_python, str(PEERS_DIR / "make_gguf.py"), "--model", str(model_dir), "--llama-cpp-dir",
           llama_cpp_dir, "--out-dir", str(model_dir / "gguf"), "--types", ",".join(shape.gguf_types),
           "--convert-python", sys.executable]  # this venv has the converter's torch and transformers
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def parse_shapes(text: str) -> list[Shape]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown shapes {unknown}; known: {','.join(SHAPES)}")
    return [SHAPES[n] for n in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/shapes"), help="parent directory (default /tmp/shapes)")
    parser.add_argument("--shapes", type=parse_shapes, default=[s for s in SHAPES.values() if s.default],
                        help=f"comma list of {','.join(SHAPES)} (default: "
                             f"{','.join(s.name for s in SHAPES.values() if s.default)})")
    parser.add_argument("--llamacpp-python", default="/tmp/peers/llamacpp/bin/python")
    parser.add_argument("--llama-cpp-dir", default=LLAMA_CPP_SRC, help="llama.cpp source tree (its converter)")
    parser.add_argument("--no-gguf", action="store_true", help="the HF checkpoints only")
    args = parser.parse_args(argv)
    made = {}
    for shape in args.shapes:
        model_dir = args.out / shape.name
        if has_shape(model_dir, shape):
            log(f"{shape.name}: exists in {model_dir}")
        else:
            make_checkpoint(shape, model_dir)
        if not args.no_gguf:
            ggufs = make_ggufs(shape, model_dir, args.llamacpp_python, args.llama_cpp_dir)
            log(f"{shape.name}: GGUF files {ggufs}")
        made[shape.name] = str(model_dir)
    print(json.dumps(made))
    return 0


if __name__ == "__main__":
    sys.exit(main())
