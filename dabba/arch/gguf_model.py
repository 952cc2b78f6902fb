"""A GGUF file as the checkpoint files the rest of dabba reads: its metadata mapped to a Hugging
Face config.json (the family and its hyperparameters), generation_config.json and
tokenizer_config.json (the special tokens, the chat template), and its ``tokenizer.ggml.*``
vocabulary built as a `tokenizers` tokenizer.json. The weights stay in the file (models/gguf_weights.py
reads them by their GGUF names).

What dabba cannot map is refused naming it: the architecture, a rope scaling, a tokenizer model
or pre-tokenizer, a tokenizer whose size does not fit the model's vocabulary.
"""
from __future__ import annotations

from typing import Any

from dabba.arch.gguf_file import GGUFFile

# general.architecture -> the transformers class dabba's families are keyed by (llama with
# llama.expert_count is Mixtral)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# general.file_type -> the dtype its float tensors have (the quantized types compute in bfloat16)
FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}

# tokenizer.ggml.pre -> the regex its BPE splits text with before merging (llama.cpp's llama-vocab.cpp
# and the source tokenizers the converter hashed to name them)
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"gpt-2": None, "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4


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


def _tokens(f: GGUFFile) -> list[str]:
    tokens = f.require("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{f.path}: tokenizer.ggml.tokens is not a list of strings")
    return tokens


def tokenizer_json(f: GGUFFile, vocab_size: int) -> dict[str, Any]:
    """tokenizer.json for a byte-level BPE vocabulary (tokenizer.ggml.model "gpt2": GPT-2, Llama 3,
    Qwen 2/3), with the file's tokens, merges and special tokens."""
    model = f.require("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{f.path}: tokenizer.ggml.model {model!r} is not read from GGUF yet (byte-level BPE "
                         "'gpt2' is); give the source tokenizer with --tokenizer DIR")
    pre = f.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{f.path}: tokenizer.ggml.pre {pre!r} is not one dabba knows ({', '.join(PRE_TOKENIZERS)})")
    tokens = _tokens(f)
    if len(tokens) > vocab_size:
        raise ValueError(f"{f.path}: the tokenizer has {len(tokens)} tokens, more than the model's vocabulary "
                         f"({vocab_size})")
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"{f.path}: tokenizer.ggml.tokens lists a token twice")
    types = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if not isinstance(types, list) or len(types) != len(tokens):
        raise ValueError(f"{f.path}: tokenizer.ggml.token_type does not match tokenizer.ggml.tokens")
    merges = f.get("tokenizer.ggml.merges") or []
    if not isinstance(merges, list) or not all(isinstance(m, str) and m.count(" ") == 1 for m in merges):
        raise ValueError(f"{f.path}: tokenizer.ggml.merges is not a list of 'left right' pairs")
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": types[i] == TOKEN_TYPE_CONTROL}
             for i, t in enumerate(tokens) if types[i] in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)]
    split = PRE_TOKENIZERS[pre]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": split is None}
    pre_tokenizer = byte_level if split is None else {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False}, byte_level]}
    bos = f.get("tokenizer.ggml.bos_token_id")
    add_bos = bool(f.get("tokenizer.ggml.add_bos_token", False)) and isinstance(bos, int) and 0 <= bos < len(tokens)
    single: list[dict] = [{"SpecialToken": {"id": tokens[bos], "type_id": 0}}] if add_bos else []
    single.append({"Sequence": {"id": "A", "type_id": 0}})
    specials = {tokens[bos]: {"id": tokens[bos], "ids": [bos], "tokens": [tokens[bos]]}} if add_bos else {}
    post = {"type": "TemplateProcessing", "single": single, "pair": single + [{"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": specials}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": pre_tokenizer, "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": pre in ("llama-bpe", "llama3"),
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": [m.split(" ") for m in merges]},
    }


def tokenizer_config(f: GGUFFile) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens by name and the chat template."""
    tokens = _tokens(f)
    cfg: dict[str, Any] = {}
    for name in ("bos", "eos", "padding"):
        token_id = f.get(f"tokenizer.ggml.{name}_token_id")
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            cfg["pad_token" if name == "padding" else f"{name}_token"] = tokens[token_id]
    template = f.get("tokenizer.chat_template")
    if isinstance(template, str):
        cfg["chat_template"] = template
    return cfg


def generation_config(f: GGUFFile) -> dict[str, Any]:
    eos = f.get("tokenizer.ggml.eos_token_id")
    eot = f.get("tokenizer.ggml.eot_token_id")
    ids = [i for i in (eos, eot) if isinstance(i, int)]
    return {"eos_token_id": ids} if ids else {}
