"""A GGUF file's ``tokenizer.ggml.*`` vocabulary built as a `tokenizers` tokenizer.json, and its
special tokens and chat template as tokenizer_config.json.

Two kinds of vocabulary: byte-level BPE (tokenizer.ggml.model "gpt2": GPT-2, Llama 3, Qwen) and
SentencePiece BPE ("llama": Llama 2, Mistral, Phi-3, Gemma), each built as transformers builds
the source model's tokenizer. What dabba cannot build is refused naming it: a tokenizer model or
pre-tokenizer it does not know, a vocabulary larger than the model's, a merge, score or token type
list that does not fit it.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable

from dabba.arch.gguf_file import GGUFFile

# tokenizer.ggml.pre -> the regex its BPE splits text with before merging (llama.cpp's llama-vocab.cpp
# and the source tokenizers the converter hashed to name them)
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"gpt-2": None, "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}
# tokenizer.ggml.token_type: llama.cpp's llama_token_type (0 undefined)
TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNUSED, \
    TOKEN_TYPE_BYTE = range(1, 7)
SPM_SPACE = "\u2581"  # SentencePiece writes a space as this
BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")  # a byte fallback piece, as SentencePiece and tokenizers spell it


def _tokens(f: GGUFFile) -> list[str]:
    tokens = f.require("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{f.path}: tokenizer.ggml.tokens is not a list of strings")
    return tokens


def _vocabulary(f: GGUFFile, vocab_size: int) -> list[str]:
    """The tokens, each once and no more than the model has embeddings for."""
    tokens = _tokens(f)
    if len(tokens) > vocab_size:
        raise ValueError(f"{f.path}: the tokenizer has {len(tokens)} tokens, more than the model's vocabulary "
                         f"({vocab_size})")
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"{f.path}: tokenizer.ggml.tokens lists a token twice")
    return tokens


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_types(f: GGUFFile, count: int) -> list[int]:
    """Each token's type (all normal where the file has none)."""
    types = f.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * count
    if not isinstance(types, list) or len(types) != count:
        raise ValueError(f"{f.path}: tokenizer.ggml.token_type does not match tokenizer.ggml.tokens")
    if not all(_is_int(t) and 0 <= t <= TOKEN_TYPE_BYTE for t in types):
        raise ValueError(f"{f.path}: tokenizer.ggml.token_type holds a value that is not a token type "
                         f"(0 to {TOKEN_TYPE_BYTE})")
    return types


def _flag(f: GGUFFile, key: str, default: bool) -> bool:
    value = f.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{f.path}: {key} is {value!r}, not true or false")
    return value


def _token_id(f: GGUFFile, name: str, tokens: list[str]) -> int | None:
    """tokenizer.ggml.<name>_token_id where it names a token of the vocabulary."""
    token_id = f.get(f"tokenizer.ggml.{name}_token_id")
    return token_id if _is_int(token_id) and 0 <= token_id < len(tokens) else None


def _added_tokens(tokens: list[str], types: list[int]) -> list[dict[str, Any]]:
    """Control and unknown tokens are special; user-defined ones are matched whole in the text too
    but are not special (decoded with the text), as llama.cpp and transformers treat them."""
    special = (TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL)
    return [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": types[i] in special}
            for i, t in enumerate(tokens) if types[i] in (*special, TOKEN_TYPE_USER_DEFINED)]


def _post_processor(f: GGUFFile, tokens: list[str], add_bos_default: bool) -> dict[str, Any]:
    """BOS and EOS around each sequence where the file asks for them (and names them), as
    transformers' tokenizers add them."""
    bos, eos = _token_id(f, "bos", tokens), _token_id(f, "eos", tokens)
    add_bos = _flag(f, "tokenizer.ggml.add_bos_token", add_bos_default) and bos is not None
    add_eos = _flag(f, "tokenizer.ggml.add_eos_token", False) and eos is not None
    added = [i for i, add in ((bos, add_bos), (eos, add_eos)) if add]

    def template(sequence: str, type_id: int) -> list[dict[str, Any]]:
        return ([{"SpecialToken": {"id": tokens[bos], "type_id": type_id}}] if add_bos else []) + \
            [{"Sequence": {"id": sequence, "type_id": type_id}}] + \
            ([{"SpecialToken": {"id": tokens[eos], "type_id": type_id}}] if add_eos else [])

    return {"type": "TemplateProcessing", "single": template("A", 0), "pair": template("A", 0) + template("B", 1),
            "special_tokens": {tokens[i]: {"id": tokens[i], "ids": [i], "tokens": [tokens[i]]} for i in added}}


def _bpe_model(tokens: list[str], merges: list[list[str]], **options: Any) -> dict[str, Any]:
    return {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges, **options}


def _byte_level_bpe(f: GGUFFile, tokens: list[str], types: list[int]) -> dict[str, Any]:
    """GPT-2's byte-level BPE (Llama 3, Qwen 2/3): the file's merges, its pre-tokenizer's split."""
    pre = f.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{f.path}: tokenizer.ggml.pre {pre!r} is not one dabba knows ({', '.join(PRE_TOKENIZERS)})")
    merges = f.get("tokenizer.ggml.merges") or []
    if not isinstance(merges, list) or not all(isinstance(m, str) and m.count(" ") == 1 for m in merges):
        raise ValueError(f"{f.path}: tokenizer.ggml.merges is not a list of 'left right' pairs")
    split = PRE_TOKENIZERS[pre]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": split is None}
    pre_tokenizer = byte_level if split is None else {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False}, byte_level]}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": _added_tokens(tokens, types),
        "normalizer": None, "pre_tokenizer": pre_tokenizer,
        "post_processor": _post_processor(f, tokens, add_bos_default=False),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": _bpe_model(tokens, [m.split(" ") for m in merges], ignore_merges=pre in ("llama-bpe", "llama3")),
    }


def _scores(f: GGUFFile, count: int) -> list[float]:
    scores = f.require("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != count:
        raise ValueError(f"{f.path}: tokenizer.ggml.scores does not match tokenizer.ggml.tokens (one score a token)")
    if not all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) for s in scores):
        raise ValueError(f"{f.path}: tokenizer.ggml.scores holds a value that is not a finite number")
    return scores


def _check_byte_tokens(f: GGUFFile, tokens: list[str], types: list[int]) -> None:
    """A byte token is what the model falls back to for a byte outside the vocabulary: tokenizers
    looks it up by its <0xNN> spelling, so it must be spelled so."""
    for i, (token, token_type) in enumerate(zip(tokens, types)):
        if token_type == TOKEN_TYPE_BYTE and not BYTE_TOKEN.fullmatch(token):
            raise ValueError(f"{f.path}: token {i} {token!r} is a byte token (tokenizer.ggml.token_type "
                             f"{TOKEN_TYPE_BYTE}) but not spelled <0xNN>")


def _unknown_token(f: GGUFFile, tokens: list[str], types: list[int]) -> str | None:
    """What a character with no byte token to fall back to becomes."""
    unk = _token_id(f, "unknown", tokens)
    if unk is None:
        unk = next((i for i, t in enumerate(types) if t == TOKEN_TYPE_UNKNOWN), None)
    return None if unk is None else tokens[unk]


def _merges_by_score(tokens: list[str], scores: list[float]) -> list[list[str]]:
    """SentencePiece's BPE joins first the adjacent pair whose joined piece scores highest: every
    piece that splits into two pieces of the vocabulary is a merge, ranked by its score, then its
    id, then the shorter left part first (transformers' SentencePieceExtractor, which ranks by id:
    the same order, as a SentencePiece BPE model's pieces score lower as their ids rise)."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = sorted((-scores[i], i, cut) for i, token in enumerate(tokens) for cut in range(1, len(token))
                    if token[:cut] in ids and token[cut:] in ids)
    return [[tokens[i][:cut], tokens[i][cut:]] for _, i, cut in ranked]


def _sentencepiece_bpe(f: GGUFFile, tokens: list[str], types: list[int]) -> dict[str, Any]:
    """SentencePiece's BPE as transformers' LlamaTokenizer (GemmaTokenizer without the prefix
    space) builds it: spaces written as SPM_SPACE, one prepended to the text unless
    tokenizer.ggml.add_space_prefix is false, merges from the scores, bytes outside the vocabulary
    as their <0xNN> tokens; the decoder undoes each. tokenizer.ggml.pre ("default") is not read, as
    llama.cpp reads none for this model."""
    merges = _merges_by_score(tokens, _scores(f, len(tokens)))
    _check_byte_tokens(f, tokens, types)
    prefix = _flag(f, "tokenizer.ggml.add_space_prefix", True)
    decoders = [{"type": "Replace", "pattern": {"String": SPM_SPACE}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}]
    if prefix:  # after Fuse: the text's first space only
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": _added_tokens(tokens, types),
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": SPM_SPACE,
                          "prepend_scheme": "first" if prefix else "never", "split": False},
        "post_processor": _post_processor(f, tokens, add_bos_default=True),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": _bpe_model(tokens, merges, unk_token=_unknown_token(f, tokens, types), fuse_unk=True,
                            byte_fallback=True),
    }


BUILDERS: dict[str, Callable[[GGUFFile, list[str], list[int]], dict[str, Any]]] = {
    "gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


def tokenizer_json(f: GGUFFile, vocab_size: int) -> dict[str, Any]:
    """tokenizer.json for the file's vocabulary, with its tokens, merges and special tokens."""
    model = f.require("tokenizer.ggml.model")
    if model not in BUILDERS:
        raise ValueError(f"{f.path}: tokenizer.ggml.model {model!r} is not read from GGUF yet (byte-level BPE "
                         "'gpt2' and SentencePiece 'llama' are); give the source tokenizer with --tokenizer DIR")
    tokens = _vocabulary(f, vocab_size)
    return BUILDERS[model](f, tokens, _token_types(f, len(tokens)))


def tokenizer_config(f: GGUFFile) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens by name and the chat template."""
    tokens = _tokens(f)
    cfg: dict[str, Any] = {}
    for name in ("bos", "eos", "padding"):
        token_id = _token_id(f, name, tokens)
        if token_id is not None:
            cfg["pad_token" if name == "padding" else f"{name}_token"] = tokens[token_id]
    template = f.get("tokenizer.chat_template")
    if isinstance(template, str):
        cfg["chat_template"] = template
    return cfg
