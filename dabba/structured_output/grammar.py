"""The xgrammar backend: a constraint -> xgrammar Grammar (validation: a bad schema, regex or
grammar is a ValueError naming the field) -> CompiledGrammar for this tokenizer (the costly part,
done in a compiler process, compile_pool.py) -> one GrammarMatcher per request."""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import xgrammar as xgr

from dabba.errors import InvalidRequest
from dabba.structured_output.params import StructuredOutputsParams


def vocab_type(tokenizer_json: dict[str, Any]) -> tuple[xgr.VocabType, bool]:
    """How the tokenizer spells bytes in its vocabulary, and whether it adds a prefix space, from
    tokenizer.json's decoder: ByteLevel (GPT-2, Llama 3, Qwen), ByteFallback (SentencePiece:
    Llama 2, Gemma, Phi-3; a ``Strip`` of one leading space means the encoder prepended it) or
    neither (raw text tokens)."""
    decoder = tokenizer_json.get("decoder") or {}
    decoders = decoder.get("decoders") or [] if decoder.get("type") == "Sequence" else [decoder]
    types = {d.get("type") for d in decoders}
    if "ByteLevel" in types:
        return xgr.VocabType.BYTE_LEVEL, False
    if "ByteFallback" in types:
        strips_space = any(d.get("type") == "Strip" and d.get("content") == " " and d.get("start", 0) > 0
                           for d in decoders)
        return xgr.VocabType.BYTE_FALLBACK, strips_space
    return xgr.VocabType.RAW, False


def tokenizer_info(tokenizer_json: dict[str, Any], vocab: dict[str, int], vocab_size: int,
                   stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """``vocab_size`` is the model's (its logits' width), which may exceed the tokenizer's: ids
    without a token are never allowed."""
    encoded = [""] * vocab_size
    for token, token_id in vocab.items():
        if token_id < vocab_size:
            encoded[token_id] = token
    kind, add_prefix_space = vocab_type(tokenizer_json)
    return xgr.TokenizerInfo(encoded, kind, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None,
                             add_prefix_space=add_prefix_space)


def admits_no_token(row: np.ndarray) -> bool:
    """Whether a bitmask row (its int32 words) allows no token: the grammar can neither go on
    nor end there (an end would allow a stop token)."""
    return not row.any()


def _choice_ebnf(choices: tuple[str, ...]) -> str:
    # JSON string escapes (\" \\ \n \uXXXX) are EBNF string escapes too
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


# With any whitespace allowed, a run between two JSON tokens holds at most this many characters
# (llama.cpp's JSON grammars allow a newline and 20 spaces or tabs): indentation fits, and a weak
# model cannot spend its tokens on whitespace forever.
MAX_JSON_WHITESPACE = 20

# xgrammar (0.2.9) spells a length-bounded JSON string's character as any but quote, backslash,
# CR and LF: raw control characters (U+0000-U+001F), which JSON forbids unescaped, get through
# and strict parsers refuse the output. Its unbounded strings exclude them; so do these.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def _json_grammar(schema: str, strict: bool, compact: bool) -> xgr.Grammar:
    """A JSON schema's grammar, ``compact``: no whitespace between tokens (else runs of at most
    MAX_JSON_WHITESPACE), bounded strings without raw control characters."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=not compact, strict_mode=strict,
                                           max_whitespace_cnt=None if compact else MAX_JSON_WHITESPACE)
    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def build_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The grammar a constraint means; raises ValueError naming the field when xgrammar refuses it
    (invalid or unsupported schema, regex that does not parse, EBNF syntax error)."""
    kind = params.kind
    try:
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            return _json_grammar(schema, strict=True, compact=params.disable_any_whitespace)
        if kind == "json_object":
            return _json_grammar('{"type": "object"}', strict=False, compact=params.disable_any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_ebnf(params.choice))
        return xgr.Grammar.from_ebnf(params.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        message = str(e).splitlines()[-1] if str(e).strip() else type(e).__name__
        message = message.split(": ", 1)[1] if message.startswith("[") and ": " in message else message
        raise InvalidRequest("structured_outputs", f"structured_outputs.{kind} is invalid: {message}") from None
