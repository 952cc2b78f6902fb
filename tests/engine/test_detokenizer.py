"""Incremental detokenization and stop strings: the detokenizer alone on the tiny byte-level BPE
tokenizer, then stop strings end to end through the engine."""
from __future__ import annotations

import pytest

from dabba import LLM, SamplingParams
from dabba.engine.detokenizer import IncrementalDetokenizer
from dabba.engine.tokenizer import Tokenizer
from tests.conftest import Checkpoint

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def llama(checkpoints) -> Checkpoint:
    return checkpoints["llama"]


@pytest.fixture(scope="module")
def tokenizer(llama) -> Tokenizer:
    return Tokenizer(llama.path)


def detokenizer(tokenizer: Tokenizer, **params) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, SamplingParams(**params))


def feed_one_by_one(detok: IncrementalDetokenizer, token_ids: list[int]) -> tuple[list[str | None], list[str]]:
    """update() with one token at a time; returns what each call returned and the streamed text after it."""
    matches, texts = [], []
    for token_id in token_ids:
        matches.append(detok.update([token_id]))
        texts.append(detok.output_text(finished=False))
    return matches, texts


def completing_index(tokenizer: Tokenizer, token_ids: list[int], stop: str) -> int:
    """Index of the token after which the full decode first contains ``stop`` (the oracle)."""
    return next(k for k in range(len(token_ids)) if stop in tokenizer.decode(token_ids[: k + 1]))


def assert_prefix_chain(texts: list[str], final: str) -> None:
    for before, after in zip(texts, texts[1:] + [final]):
        assert after.startswith(before), (before, after)


# ---- the detokenizer alone -----------------------------------------------------------------

ROUND_TRIP_TEXTS = [
    "Return a new list.",
    "café é, naïve",
    "漢字 and 漢",
    "a 🙂 b",
    "🙂🙂é漢🙂",
    "Mixed: x = 1  # 🙂 done\n\tnext 字",
]


def test_emoji_is_split_across_byte_tokens(tokenizer) -> None:
    # Otherwise the round-trip tests below would not exercise partial characters.
    assert len(tokenizer.encode("🙂", add_special_tokens=False)) > 1
    assert len(tokenizer.encode("漢", add_special_tokens=False)) > 1
    assert len(tokenizer.encode("é", add_special_tokens=False)) > 1


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip_one_token_at_a_time(tokenizer, text) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    detok = detokenizer(tokenizer)
    matches, texts = feed_one_by_one(detok, ids)
    final = detok.output_text(finished=True)
    assert matches == [None] * len(ids)
    assert final == tokenizer.decode(ids) == text
    assert_prefix_chain(texts, final)
    assert [t for t in texts if REPLACEMENT in t] == []
    # Without stop strings nothing is held back: the stream is every complete character so far.
    for k, streamed in enumerate(texts):
        assert streamed == tokenizer.decode(ids[: k + 1]).rstrip(REPLACEMENT)
    deltas = [b[len(a):] for a, b in zip([""] + texts, texts + [final])]
    assert "".join(deltas) == final


def test_partial_character_is_not_streamed_until_complete(tokenizer) -> None:
    prefix_ids = tokenizer.encode("a ", add_special_tokens=False)
    emoji_ids = tokenizer.encode("🙂", add_special_tokens=False)
    detok = detokenizer(tokenizer)
    detok.update(prefix_ids)
    for token_id in emoji_ids[:-1]:
        detok.update([token_id])
        assert detok.output_text(finished=False) == "a "
    detok.update(emoji_ids[-1:])
    assert detok.output_text(finished=False) == "a 🙂"
    assert detok.output_text(finished=True) == "a 🙂"


def test_unfinished_character_at_the_end_decodes_as_a_full_decode(tokenizer) -> None:
    ids = tokenizer.encode("a 🙂", add_special_tokens=False)[:-1]  # last byte of the emoji missing
    detok = detokenizer(tokenizer)
    detok.update(ids)
    assert detok.output_text(finished=False) == "a "
    assert detok.output_text(finished=True) == tokenizer.decode(ids)
    assert tokenizer.decode(ids).startswith("a ") and tokenizer.decode(ids).endswith(REPLACEMENT)


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory) -> Tokenizer:
    """A SentencePiece tokenizer with byte fallback (Llama 2's kind): characters outside its
    vocabulary are <0xNN> byte tokens, which a model may emit in any order."""
    from tools.tiny_checkpoint import save_sentencepiece_tokenizer

    directory = tmp_path_factory.mktemp("sentencepiece")
    save_sentencepiece_tokenizer(directory, "llama", 1000)
    return Tokenizer(directory)


def test_a_byte_that_unmakes_a_streamed_character_does_not_stop_the_stream(sentencepiece) -> None:
    """<0x43> streams as "C"; <0xBF> after it makes the pair invalid UTF-8, which the whole decode
    writes as two U+FFFD: the stream goes on, and the finished text is the whole decode."""
    hf = sentencepiece.hf_tokenizer
    ids = [hf.token_to_id(t) for t in ("<0x43>", "<0xBF>", "\u2581the", "\u2581list", "<0xF0>", "<0x9F>",
                                       "<0x99>", "<0x82>")]
    assert None not in ids
    for params in ({}, {"stop": ["xyz"]}):
        detok = detokenizer(sentencepiece, **params)
        matches, texts = feed_one_by_one(detok, ids)
        assert matches == [None] * len(ids)
        if not params:  # (a stop string holds the last characters back)
            assert texts[0] == "C" and texts[-1].endswith(" the list🙂")
        assert detok.output_text(finished=True) == sentencepiece.decode(ids) == "\ufffd\ufffd the list🙂"


@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_string_spanning_several_tokens(tokenizer, include_stop) -> None:
    text, stop = "Return a new list.", "a new li"  # starts inside " a", ends inside " list"
    ids = tokenizer.encode(text, add_special_tokens=False)
    k = completing_index(tokenizer, ids, stop)
    first = next(i for i in range(len(ids)) if "a" in tokenizer.decode(ids[: i + 1])[len("Return"):])
    assert k - first >= 2 and k < len(ids) - 1  # spans at least 3 tokens, and tokens follow it

    detok = detokenizer(tokenizer, stop=[stop], include_stop_str_in_output=include_stop)
    matches, _ = feed_one_by_one(detok, ids[: k + 1])
    assert matches == [None] * k + [stop]
    expected = "Return a new li" if include_stop else "Return "
    assert detok.output_text(finished=True) == expected
    # Once stopped, further tokens change nothing.
    assert detok.update(ids[k + 1:]) is None
    assert detok.update(ids[k + 1:]) is None
    assert detok.output_text(finished=True) == expected


@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_string_found_when_tokens_arrive_together(tokenizer, include_stop) -> None:
    ids = tokenizer.encode("Return a new list.", add_special_tokens=False)
    detok = detokenizer(tokenizer, stop="a new li", include_stop_str_in_output=include_stop)
    assert detok.update(ids) == "a new li"
    assert detok.output_text(finished=True) == ("Return a new li" if include_stop else "Return ")


@pytest.mark.parametrize(
    ("text", "stop", "before"),
    [
        ("a 🙂 b", "🙂", "a "),
        ("x 漢字 y", "漢", "x "),
        ("x 漢字 y", "字", "x 漢"),  # must not match on 漢's bytes
        ("café au lait", "é", "caf"),
        ("mère café", "é", "mère caf"),  # è shares é's first byte
        ("x 漢字 y", "字 y", "x 漢"),
        ("ab🙂🙂cd", "🙂c", "ab🙂"),
    ],
)
def test_stop_string_with_multibyte_characters(tokenizer, text, stop, before) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    k = completing_index(tokenizer, ids, stop)
    assert tokenizer.decode(ids[:k]).find(stop) == -1 and len(tokenizer.encode(stop, add_special_tokens=False)) > 1

    for include_stop, expected in ((False, before), (True, before + stop)):
        detok = detokenizer(tokenizer, stop=[stop], include_stop_str_in_output=include_stop)
        matches, texts = feed_one_by_one(detok, ids)
        assert matches == [None] * k + [stop] + [None] * (len(ids) - k - 1)
        assert detok.output_text(finished=True) == expected
        assert [t for t in texts if REPLACEMENT in t] == []
        assert_prefix_chain(texts[:k], expected)


def test_possible_stop_prefix_is_held_back_then_released(tokenizer) -> None:
    text = "ab ## cd ### ef"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = detokenizer(tokenizer, stop="###")
    decoded, streamed = [], []
    for token_id in ids:
        match = detok.update([token_id])
        decoded.append(tokenizer.decode(ids[: len(decoded) + 1]))
        if match is not None:
            break  # the engine finishes the request: the text is output_text(finished=True) from now on
        streamed.append(detok.output_text(finished=False))
    assert match == "###"
    assert decoded[-1] == "ab ## cd ###"
    final = detok.output_text(finished=True)
    assert final == "ab ## cd "

    # While the text ends with "#" or "##", those characters are not streamed (the detokenizer
    # holds back the last len("###") - 1 = 2 characters, as its docstring says).
    assert streamed[decoded.index("ab #")] == "ab"
    assert streamed[decoded.index("ab ##")] == "ab "
    # Once the text went on differently, "##" is released.
    assert streamed[decoded.index("ab ## c")] == "ab ##"
    assert streamed[decoded.index("ab ## cd")] == "ab ## "
    assert streamed[decoded.index("ab ## cd ##")] == "ab ## cd "
    assert_prefix_chain(streamed, final)
    assert [s for s in streamed if "###" in s] == []


def test_held_back_text_is_released_when_finished_without_a_match(tokenizer) -> None:
    ids = tokenizer.encode("ab ##", add_special_tokens=False)
    detok = detokenizer(tokenizer, stop="###")
    assert detok.update(ids) is None
    assert detok.output_text(finished=False) == "ab "
    assert detok.output_text(finished=True) == "ab ##"


@pytest.mark.parametrize(("text", "stop"), [("ab ## cd ### ef", "###"), ("ab ## cd", "###"), ("a 🙂 b 🙂c", "🙂c"),
                                            ("x 漢字 y", "字 y"), *((t, None) for t in ROUND_TRIP_TEXTS)])
def test_new_output_text_hands_on_exactly_the_released_text(tokenizer, text, stop) -> None:
    """What DELTA outputs carry: after every token, the pieces so far add up to output_text()."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole, pieces = detokenizer(tokenizer, stop=stop), detokenizer(tokenizer, stop=stop)
    deltas = []
    for k, token_id in enumerate(ids):
        match = whole.update([token_id])
        assert pieces.update([token_id]) == match
        finished = match is not None or k == len(ids) - 1
        deltas.append(pieces.new_output_text(finished))
        assert "".join(deltas) == whole.output_text(finished)
        if finished:
            break
    assert pieces.new_output_text(True) == ""  # nothing is handed on twice
    assert "".join(deltas) == (text[: text.find(stop)] if stop and stop in text else text)


@pytest.mark.parametrize(
    ("stops", "matched", "before"),
    [
        (["four", "two"], "two", "one "),
        (["two", "four"], "two", "one "),
        # Both complete at the token " four"; the one that starts earlier in the text wins.
        (["four", "three four"], "three four", "one two "),
        (["three four", "four"], "three four", "one two "),
        # "three" is complete before "two three four" is: the text stops at the first completed.
        (["two three four", "three"], "three", "one two "),
    ],
)
def test_multiple_stop_strings_earliest_wins(tokenizer, stops, matched, before) -> None:
    ids = tokenizer.encode("one two three four five", add_special_tokens=False)
    k = completing_index(tokenizer, ids, matched)
    detok = detokenizer(tokenizer, stop=stops)
    matches, _ = feed_one_by_one(detok, ids)
    assert matches == [None] * k + [matched] + [None] * (len(ids) - k - 1)
    assert detok.output_text(finished=True) == before
    # The same when all tokens arrive in one update.
    detok = detokenizer(tokenizer, stop=stops)
    assert detok.update(ids) == matched
    assert detok.output_text(finished=True) == before


@pytest.mark.parametrize(("skip", "expected"), [(True, "hello"), (False, "<s>hello</s>")])
def test_skip_special_tokens(tokenizer, skip, expected) -> None:
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    assert (bos, eos) == (0, 1)
    ids = [bos, *tokenizer.encode("hello", add_special_tokens=False), eos]
    detok = detokenizer(tokenizer, skip_special_tokens=skip)
    _, texts = feed_one_by_one(detok, ids)
    assert texts[-1] == expected
    assert texts[0] == ("" if skip else "<s>")
    assert detok.output_text(finished=True) == expected == tokenizer.decode(ids, skip_special_tokens=skip)


def test_stop_string_on_special_token_text_only_when_kept(tokenizer) -> None:
    ids = [*tokenizer.encode("hello", add_special_tokens=False), tokenizer.eos_token_id]
    kept = detokenizer(tokenizer, stop="</s>", skip_special_tokens=False)
    assert kept.update(ids) == "</s>"
    assert kept.output_text(finished=True) == "hello"
    skipped = detokenizer(tokenizer, stop="</s>", skip_special_tokens=True)
    assert skipped.update(ids) is None
    assert skipped.output_text(finished=True) == "hello"


# ---- end to end through the engine ---------------------------------------------------------

PROMPT = "Return a new list."
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def llm(llama) -> LLM:
    return LLM(str(llama.path), dtype="float32")


@pytest.fixture(scope="module")
def reference(llm) -> tuple[list[int], str]:
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == MAX_TOKENS and out.finish_reason == "length"
    assert out.text == llm.get_tokenizer().decode(out.token_ids)
    return out.token_ids, out.text


def choose_stop(tokenizer: Tokenizer, token_ids: list[int], text: str) -> tuple[str, int, int]:
    """A substring of ``text`` that starts inside token j (not on its boundary, and past the first
    few characters) and ends at the end of token j+2, occurring first there. Returns it, where
    it starts, and the index of the token that completes it."""
    ends = [len(tokenizer.decode(token_ids[:k])) for k in range(len(token_ids) + 1)]
    clean = [tokenizer.decode(token_ids[:k]) == text[: ends[k]] for k in range(len(token_ids) + 1)]
    for j in range(len(token_ids) - 3):
        if not all(clean[j: j + 4]) or ends[j + 1] - ends[j] < 2:
            continue
        if ends[j + 2] <= ends[j + 1] or ends[j + 3] <= ends[j + 2]:
            continue  # tokens j+1 and j+2 must add text
        start, end = ends[j] + 1, ends[j + 3]
        stop = text[start:end]
        if start >= 3 and REPLACEMENT not in stop and text.find(stop) == start:
            return stop, start, j + 2
    raise AssertionError(f"no usable stop string in {text!r}")


def stream_request(llm: LLM, request_id: str, params: SamplingParams) -> list:
    engine = llm.llm_engine
    engine.add_request(request_id, PROMPT, params)
    outputs = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == request_id
            outputs.append(out)
    return outputs


@pytest.mark.parametrize("include_stop", [False, True])
def test_engine_stop_string(llm, reference, include_stop) -> None:
    tokenizer = llm.get_tokenizer()
    ref_ids, ref_text = reference
    stop, start, k = choose_stop(tokenizer, ref_ids, ref_text)
    assert completing_index(tokenizer, ref_ids, stop) == k

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop],
                            include_stop_str_in_output=include_stop)
    outputs = stream_request(llm, f"stop-{include_stop}", params)
    final = outputs[-1].outputs[0]
    expected_text = ref_text[: start + len(stop)] if include_stop else ref_text[:start]
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert final.text == expected_text
    assert final.token_ids == ref_ids[: k + 1]

    # One output per generated token; only the last is finished; the text only grows.
    assert [o.outputs[0].token_ids for o in outputs] == [ref_ids[: i + 1] for i in range(k + 1)]
    assert [o.finished for o in outputs] == [False] * k + [True]
    assert [o.outputs[0].finish_reason for o in outputs] == [None] * k + ["stop"]
    texts = [o.outputs[0].text for o in outputs]
    assert_prefix_chain(texts, final.text)
    assert "".join(b[len(a):] for a, b in zip([""] + texts, texts)) == final.text
    assert [t for t in texts[:-1] if stop in t] == []
    assert not llm.llm_engine.output_processor.parents


def test_engine_stop_string_on_the_last_allowed_token(llm, reference) -> None:
    tokenizer = llm.get_tokenizer()
    ref_ids, ref_text = reference
    stop, start, k = choose_stop(tokenizer, ref_ids, ref_text)
    params = SamplingParams(temperature=0, max_tokens=k + 1, ignore_eos=True, stop=[stop])
    final = stream_request(llm, "stop-last", params)[-1].outputs[0]
    assert final.token_ids == ref_ids[: k + 1]
    assert final.text == ref_text[:start]
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)


def test_engine_stop_string_does_not_count_before_min_tokens(llm, reference) -> None:
    tokenizer = llm.get_tokenizer()
    ref_ids, ref_text = reference
    stop, _, k = choose_stop(tokenizer, ref_ids, ref_text)
    assert ref_text.count(stop) == 1  # so, ignored at its only occurrence, it never stops the request
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=k + 2, ignore_eos=True, stop=[stop])
    final = stream_request(llm, "stop-min-tokens", params)[-1].outputs[0]
    assert final.token_ids == ref_ids
    assert final.text == ref_text
    assert (final.finish_reason, final.stop_reason) == ("length", None)
