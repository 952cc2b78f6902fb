"""A GGUF file's metadata as a checkpoint (arch/gguf_model.py, models/gguf_checkpoint.py), on files
gguf-py's writer makes here: the config and tokenizer it maps to, and every way the metadata or
tensors can fail to describe a model, each a ValueError naming the file (no converter needed:
tests/test_gguf_models.py checks llama.cpp's own files against transformers)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGUFWriter

from dabba import LLM, SamplingParams
from dabba.models.gguf_checkpoint import gguf_model_dir

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, VOCAB = 32, 4, 2, 48, 2, 64
TOKENS = ["<s>", "</s>", "ab", "cd"] + [chr(c) for c in range(ord("a"), ord("a") + VOCAB - 4)]


def write(path, drop=(), extra=(), tokens=TOKENS, arch="llama", metadata=None, merges=("a b", "c d")) -> str:
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), arch)
    meta = {"block_count": LAYERS, "context_length": 128, "embedding_length": HIDDEN, "feed_forward_length": FFN,
            "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS, **(metadata or {})}
    for key, value in meta.items():
        (w.add_string if isinstance(value, str) else w.add_uint32)(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", list(tokens))
    w.add_array("tokenizer.ggml.token_type", [3, 3] + [1] * (len(tokens) - 2))
    w.add_array("tokenizer.ggml.merges", list(merges))
    w.add_uint32("tokenizer.ggml.bos_token_id", 0)
    w.add_uint32("tokenizer.ggml.eos_token_id", 1)
    w.add_string("tokenizer.chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,), "output.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                       f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN),
                       f"blk.{i}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
                       f"blk.{i}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
                       f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN), f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
                       f"blk.{i}.ffn_up.weight": (FFN, HIDDEN), f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)})
    shapes.update({name: (HIDDEN,) for name in extra})
    for name, shape in shapes.items():
        if name not in drop:
            w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_the_metadata_maps_to_a_config_a_tokenizer_and_a_model_that_serves(tmp_path) -> None:
    directory = gguf_model_dir(write(tmp_path / "tiny.gguf"))
    config = json.loads((directory / "config.json").read_text())
    assert {k: config[k] for k in ("architectures", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                   "head_dim", "num_hidden_layers", "vocab_size", "tie_word_embeddings")} == {
        "architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HIDDEN // HEADS, "num_hidden_layers": LAYERS, "vocab_size": VOCAB,
        "tie_word_embeddings": False}
    assert json.loads((directory / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
    llm = LLM(str(tmp_path / "tiny.gguf"), dtype="float32", kv_cache_memory=2**22)
    tokenizer = llm.get_tokenizer()
    assert tokenizer.encode("abcde", add_special_tokens=False) == [2, 3, TOKENS.index("e")]  # the file's merges
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    out = llm.generate("abc", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("kwargs, message", [
    ({"arch": "falcon"}, "GGUF architecture 'falcon' is not one dabba serves from GGUF"),
    ({"metadata": {"attention.head_count": 0}}, "metadata 'llama.attention.head_count' is 0, not a positive integer"),
    ({"metadata": {"block_count": "two"}}, "metadata 'llama.block_count' is 'two', not a positive integer"),
    ({"metadata": {"vocab_size": 70}}, "llama.vocab_size is 70 but token_embd.weight has 64 rows"),
    ({"tokens": ["<s>", "</s>"] + [f"t{i}" for i in range(100)]}, "the tokenizer has 102 tokens, more than the model"),
    ({"tokens": ["<s>", "</s>", "x", "x"]}, "tokenizer.ggml.tokens lists a token twice"),
    ({"merges": ("a b", "q r")}, "tokenizer.ggml.* do not make a tokenizer"),
    ({"merges": ("abc",)}, "tokenizer.ggml.merges is not a list of 'left right' pairs"),
    ({"extra": ["blk.0.mystery.weight"]}, "the GGUF file holds a tensor dabba does not know: 'blk.0.mystery.weight'"),
    ({"extra": ["blk.7.attn_norm.weight"]}, "a tensor dabba does not know: 'blk.7.attn_norm.weight'"),
    ({"drop": ["token_embd.weight"]}, "has no token_embd.weight"),
])
def test_what_does_not_describe_a_model_is_a_value_error_naming_the_file(tmp_path, kwargs, message) -> None:
    path = write(tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(ValueError, match="bad.gguf: ") as e:
        LLM(path, dtype="float32", kv_cache_memory=2**22)
    assert message in str(e.value)


def test_a_missing_tensor_is_named(tmp_path) -> None:
    with pytest.raises(ValueError, match="missing tensors: .*model.layers.1.mlp.down_proj.weight"):
        LLM(write(tmp_path / "short.gguf", drop=["blk.1.ffn_down.weight"]), dtype="float32", kv_cache_memory=2**22)
