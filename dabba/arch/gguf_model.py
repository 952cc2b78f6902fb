"""A GGUF file as the checkpoint files the rest of dabba reads: its metadata mapped to a Hugging
Face config.json (the family and its hyperparameters), generation_config.json and
generation_config.json. Its vocabulary is arch/gguf_tokenizer.py's; the weights stay in the file
(models/gguf_checkpoint.py reads them by their GGUF names).

What dabba cannot map is refused naming it: the architecture, a rope scaling, a count that is not one.
"""
from __future__ import annotations

from typing import Any

from dabba.arch.gguf_file import GGUFFile

# general.architecture -> the transformers class dabba's families are keyed by (llama with
# llama.expert_count is Mixtral)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# general.file_type -> the dtype its float tensors have (the quantized types compute in bfloat16)
FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}



def _need(f: GGUFFile, key: str, kind: type | tuple[type, ...]) -> Any:
    value = f.require(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{f.path}: metadata {key!r} is {value!r}, not a {getattr(kind, '__name__', kind)}")
    return value


def _size(f: GGUFFile, key: str, default: int | None = None) -> int:
    """A count the model is built from: a positive integer (and not past any model)."""
    value = f.get(key, default) if default is not None else f.require(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 2**31:
        raise ValueError(f"{f.path}: metadata {key!r} is {value!r}, not a positive integer")
    return value


def hf_config(f: GGUFFile) -> dict[str, Any]:
    """config.json's fields for the file's family."""
    arch = f.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{f.path}: GGUF architecture {arch!r} is not one dabba serves from GGUF; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    heads = _size(f, f"{arch}.attention.head_count")
    hidden = _size(f, f"{arch}.embedding_length")
    if "token_embd.weight" not in f.tensors or len(f.tensors["token_embd.weight"].shape) != 2:
        raise ValueError(f"{f.path}: the GGUF file has no token_embd.weight matrix")
    vocab_size = f.tensors["token_embd.weight"].shape[0]  # llama.cpp's n_vocab, as its rows
    if f.get(f"{arch}.vocab_size", vocab_size) != vocab_size:
        raise ValueError(f"{f.path}: {arch}.vocab_size is {f.get(f'{arch}.vocab_size')!r} but token_embd.weight has "
                         f"{vocab_size} rows")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(f.get(f"{arch}.rope.freq_base", 10000.0))}
    scaling = f.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=float(_need(f, f"{arch}.rope.scaling.factor", (int, float))))
    elif scaling != "none":
        raise ValueError(f"{f.path}: rope scaling {scaling!r} is not read from GGUF yet (none, linear and "
                         "rope_freqs.weight are)")
    if "rope_freqs.weight" in f.tensors:  # Llama 3's scaling, as the converter writes it: a divisor per frequency
        freqs = f.tensors["rope_freqs.weight"]
        if freqs.type_name != "F32" or len(freqs.shape) != 1:
            raise ValueError(f"{f.path}: rope_freqs.weight is {freqs.type_name} {freqs.shape}, not a float32 vector")
        rope.update(rope_type="freq_factors", freq_factors=freqs.data.view("<f4").tolist())
    cfg = {
        "architectures": [ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": _size(f, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _size(f, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _size(f, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _size(f, f"{arch}.attention.key_length", max(hidden // heads, 1)),
        "rms_norm_eps": float(_need(f, f"{arch}.attention.layer_norm_rms_epsilon", (int, float))),
        "max_position_embeddings": _size(f, f"{arch}.context_length"),
        "rope_parameters": rope,
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "hidden_act": "silu",
        "dtype": FILE_DTYPES.get(f.get("general.file_type"), "bfloat16"),
        "attention_bias": "blk.0.attn_q.bias" in f.tensors,
    }
    experts = f.get(f"{arch}.expert_count", 0)
    if arch == "llama" and experts:  # Mixtral: Llama's block with its experts
        cfg.update(architectures=["MixtralForCausalLM"], num_local_experts=_size(f, "llama.expert_count"),
                   num_experts_per_tok=_size(f, "llama.expert_used_count"))
    elif experts:
        raise ValueError(f"{f.path}: experts in a {arch} file are not read from GGUF yet")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        gguf_key = f"tokenizer.ggml.{key.replace('pad_', 'padding_')}"
        if isinstance(f.get(gguf_key), int):
            cfg[key] = f.get(gguf_key)
    return cfg


def generation_config(f: GGUFFile) -> dict[str, Any]:
    eos = f.get("tokenizer.ggml.eos_token_id")
    eot = f.get("tokenizer.ggml.eot_token_id")
    ids = [i for i in (eos, eot) if isinstance(i, int)]
    return {"eos_token_id": ids} if ids else {}
