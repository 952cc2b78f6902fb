"""benchmarks/peers/make_gguf.py's tokenizer padding (the conversion itself needs llama.cpp's tree), and
the shapes benchmarks/peers/make_shapes.py writes."""
from __future__ import annotations

import json

from benchmarks.peers.make_gguf import padded_vocabulary


def test_a_tokenizer_shorter_than_the_vocabulary_is_padded_in_a_view(checkpoints, tmp_path) -> None:
    src = checkpoints["gemma3"].path
    tok = json.loads((src / "tokenizer.json").read_text())
    have = len(tok["model"]["vocab"]) + len(tok["added_tokens"])
    vocab_size = json.loads((src / "config.json").read_text())["vocab_size"]
    assert have >= vocab_size  # the suite's checkpoints cover their vocabulary (specials count twice): no view
    with padded_vocabulary(src) as view:
        assert view == src
    big = tmp_path / "big"
    big.mkdir()
    for f in src.iterdir():
        (big / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((big / "config.json").read_text())
    (big / "config.json").write_text(json.dumps({**cfg, "vocab_size": have + 100}))
    with padded_vocabulary(big) as view:
        padded = json.loads((view / "tokenizer.json").read_text())
        assert len(padded["model"]["vocab"]) + len(padded["added_tokens"]) == have + 100
        assert padded["added_tokens"][-1] == {"id": have + 99, "content": f"<unused{have + 99}>", "single_word": False,
                                              "lstrip": False, "rstrip": False, "normalized": False, "special": True}
        assert (view / "model.safetensors").resolve() == (big / "model.safetensors").resolve()
    assert json.loads((big / "tokenizer.json").read_text()) == tok  # the checkpoint itself is untouched


# The published parameter counts of the models whose shapes benchmarks/peers/make_shapes.py copies.
PUBLISHED_PARAMS = {"smollm2-135m": 134.5e6, "qwen2.5-0.5b": 494.0e6, "llama-3.2-1b": 1235.8e6,
                    "olmoe-1b-7b": 6.92e9,  # OLMoE-1B-7B-0924: 6.92 B on its model card
                    "gemma-3-1b": 999.89e6, "qwen2.5-1.5b": 1543.7e6, "tinyllama-1.1b": 1100.05e6}


def test_the_shapes_have_the_real_models_parameter_counts() -> None:
    import torch
    import transformers

    from benchmarks.peers.make_shapes import SHAPES
    from tools.tiny_checkpoint import ARCH_CONFIGS

    assert set(SHAPES) == set(PUBLISHED_PARAMS)
    for name, shape in SHAPES.items():
        config = getattr(transformers, ARCH_CONFIGS[shape.arch])(**shape.config)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        params = sum(p.numel() for p in model.parameters())  # a tied head is one parameter
        assert abs(params / PUBLISHED_PARAMS[name] - 1) < 0.005, (name, params)


def test_make_shapes_keeps_a_checkpoint_of_the_right_shape(tmp_path) -> None:
    import argparse

    import pytest

    from benchmarks.peers.make_shapes import SHAPES, has_shape, parse_shapes

    shape = SHAPES["smollm2-135m"]
    assert parse_shapes("smollm2-135m, llama-3.2-1b") == [shape, SHAPES["llama-3.2-1b"]]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_shapes("gpt-5")
    assert not has_shape(tmp_path, shape)
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [shape.arch], **shape.config}))
    assert has_shape(tmp_path, shape)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [shape.arch], **shape.config, "vocab_size": 1}))
    assert not has_shape(tmp_path, shape)
