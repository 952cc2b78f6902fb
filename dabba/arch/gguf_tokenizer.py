"""A GGUF file's ``tokenizer.ggml.*`` vocabulary built as a `tokenizers` tokenizer.json, and its
special tokens and chat template as tokenizer_config.json.

What dabba cannot build is refused naming it: a tokenizer model or pre-tokenizer it does not
know, a vocabulary larger than the model's, a merge or token type list that does not fit it.
"""
from __future__ import annotations

from typing import Any

from dabba.arch.gguf_file import GGUFFile

# tokenizer.ggml.pre -> the regex its BPE splits text with before merging (llama.cpp's llama-vocab.cpp
# and the source tokenizers the converter hashed to name them)
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"gpt-2": None, "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4


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
