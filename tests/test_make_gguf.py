"""benchmarks/peers/make_gguf.py's tokenizer padding (the conversion itself needs llama.cpp's tree)."""
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
