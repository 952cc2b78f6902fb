"""Structured outputs through the engine: every output of a random-weight model (which only the
constraint can make valid) parses and validates, greedy constrained decoding equals
transformers' logits under the same xgrammar mask, and batching, preemption, prefix caching,
chunked prefill, n > 1 and seeds change nothing."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from dabba import LLM, SamplingParams
from dabba.structured_output import StructuredOutputsParams
from dabba.structured_output.grammar import build_grammar, vocab_type

from tests.conftest import run_checked

# Nested, with arrays, enums, required and optional fields, string and number bounds.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}, "zip": {"type": "string", "pattern": "^[0-9]{3}$"}},
            "required": ["zip"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address"],
}
REGEX = r"(\+|-)?[0-9]{1,4}\.[a-f]{2}( [A-Z][a-z]{0,3}){1,2}"
CHOICES = ["yes", "no", "maybe so", 'say "hi"']
GRAMMAR = '''root ::= expr
expr ::= term ("+" term){0,3}
term ::= [0-9]{1,2} | "(" expr ")"'''
PROMPTS = ["Answer:", "The config is", "def f(x):", "JSON"]


@pytest.fixture(scope="module")
def llm(checkpoints) -> LLM:
    return LLM(str(checkpoints["qwen2"].path), dtype="float32", max_num_seqs=16)


def constrained(seed: int | None, temperature: float, max_tokens: int = 400, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=0.9 if temperature else 1.0, seed=seed,
                          structured_outputs=StructuredOutputsParams(**fields))


def test_every_output_satisfies_its_constraint(llm) -> None:
    settings = [(None, 0.0), (1, 0.7), (2, 1.0), (3, 1.3)]
    params, checks = [], []
    for seed, temperature in settings:
        params.append(constrained(seed, temperature, json=SCHEMA, disable_any_whitespace=True))
        checks.append(lambda text: jsonschema.validate(json.loads(text), SCHEMA))
        params.append(constrained(seed, temperature, json=json.dumps(SCHEMA)))  # any whitespace, schema as text
        checks.append(lambda text: jsonschema.validate(json.loads(text), SCHEMA))
        params.append(constrained(seed, temperature, regex=REGEX))
        checks.append(lambda text: re.fullmatch(REGEX, text) or pytest.fail(f"{text!r} does not match"))
        params.append(constrained(seed, temperature, choice=CHOICES))
        checks.append(lambda text: text in CHOICES or pytest.fail(f"{text!r} is no choice"))
        params.append(constrained(seed, temperature, grammar=GRAMMAR))
        checks.append(lambda text: re.fullmatch(r"[0-9+()]+", text) and eval(text) is not None)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    outs = run_checked(llm, prompts, params)
    for out, check in zip(outs, checks):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (completion.text, completion.finish_reason)
        check(completion.text)


def test_json_object_on_the_demo_model() -> None:
    """Any JSON object: nothing bounds its strings, so sampling may never close one. What stops
    parses as an object; what max_tokens cuts is a prefix the grammar accepts, token by token."""
    from dabba.config import DEMO_MODEL

    llm = LLM(DEMO_MODEL, dtype="float32")
    settings = [(None, 0.0, True), (1, 0.7, True), (2, 1.0, False), (3, 0.7, False), (4, 1.0, True), (5, 0.5, False)]
    params = [constrained(seed, temperature, json_object=True, disable_any_whitespace=compact)
              for seed, temperature, compact in settings]
    outs = run_checked(llm, ['Return the user as JSON: {"name": "Ann", "age": 3}. Answer:'] * len(params), params)
    manager = llm.llm_engine.engine_core.structured_output
    for out, p in zip(outs, params):
        completion = out.outputs[0]
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)
            continue
        compilation = manager.compile(p.structured_outputs)
        matcher = xgr.GrammarMatcher(compilation.future.result())
        manager.release(compilation)
        assert all(matcher.accept_token(t) for t in completion.token_ids) and not matcher.is_terminated()
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 4


def hf_constrained_greedy(path, prompt_ids: list[int], params: StructuredOutputsParams, tokenizer_json: dict,
                          vocab: dict[str, int], vocab_size: int, eos: list[int], max_new: int) -> list[int]:
    """transformers' logits, xgrammar's mask by hand, argmax: the reference for greedy decoding."""
    from transformers import AutoModelForCausalLM

    from dabba.structured_output.grammar import tokenizer_info

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer_json, vocab, vocab_size, eos))
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(build_grammar(params)))
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    ids, out = list(prompt_ids), []
    with torch.inference_mode():
        while len(out) < max_new and not matcher.is_terminated():
            logits = model(torch.tensor([ids])).logits[:, -1].float()
            matcher.fill_next_token_bitmask(bitmask, 0)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            assert matcher.accept_token(token)
            out.append(token)
            ids.append(token)
    return out


def test_greedy_equals_transformers_under_the_same_mask(llm, checkpoints) -> None:
    engine = llm.llm_engine
    tok = engine.model_info.tokenizer.hf_tokenizer
    ckpt = checkpoints["qwen2"]
    cases = [StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), StructuredOutputsParams(regex=REGEX),
             StructuredOutputsParams(grammar=GRAMMAR)]
    prompts = [ckpt.prompts[i] for i in (2, 5, 7)]
    params = [SamplingParams(max_tokens=120, temperature=0, structured_outputs=c) for c in cases]
    outs = run_checked(llm, [{"prompt_token_ids": p} for p in prompts], params)
    for prompt, case, out in zip(prompts, cases, outs):
        expected = hf_constrained_greedy(ckpt.path, prompt, case, json.loads(tok.to_str()),
                                         tok.get_vocab(with_added_tokens=True), engine.model_info.vocab_size,
                                         sorted(engine.model_info.eos_token_ids), 120)
        assert out.outputs[0].token_ids == expected


def test_unconstrained_neighbours_and_constrained_requests_are_batch_invariant(llm, checkpoints) -> None:
    ckpt = checkpoints["qwen2"]
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    alone = run_checked(llm, [{"prompt_token_ids": p} for p in ckpt.prompts[:2]], [plain, sampled])
    json_params = constrained(9, 0.9, json=SCHEMA, disable_any_whitespace=True)
    json_alone = run_checked(llm, [{"prompt_token_ids": ckpt.prompts[3]}], [json_params])
    mixed = run_checked(llm, [{"prompt_token_ids": p} for p in (ckpt.prompts[0], ckpt.prompts[3], ckpt.prompts[1])],
                        [plain, json_params, sampled])
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids == ckpt.reference[0][:24]
    assert mixed[2].outputs[0].token_ids == alone[1].outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids == json_alone[0].outputs[0].token_ids


def test_preemption_prefix_caching_chunked_prefill_and_n(checkpoints) -> None:
    """A KV cache too small for the batch (preemption by recompute), 16-token chunks, shared
    prefixes: the same tokens as a roomy engine, constraints intact, n > 1 each valid."""
    ckpt = checkpoints["qwen2"]
    prompts = [{"prompt_token_ids": ckpt.prompts[i]} for i in (8, 10, 11, 9)]
    params = [constrained(None, 0.0, 300, json=SCHEMA, disable_any_whitespace=True),
              constrained(4, 1.0, 300, json=SCHEMA, disable_any_whitespace=True),
              constrained(6, 0.8, 300, regex=REGEX),
              SamplingParams(max_tokens=200, temperature=1.0, seed=3, n=3,
                             structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})]
    roomy = run_checked(LLM(str(ckpt.path), dtype="float32"), prompts, params)
    bytes_per_block = 16 * 2 * 2 * 6 * 16 * 4  # tokens x (K, V) x layers x KV heads x head_dim x float32
    tight = LLM(str(ckpt.path), dtype="float32", kv_cache_memory=40 * bytes_per_block,
                max_num_batched_tokens=16, enable_prefix_caching=True)
    squeezed = run_checked(tight, prompts, params)
    assert tight.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert tight.get_stats().prefix_cache_hit_tokens > 0
    for a, b in zip(roomy, squeezed):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len(squeezed[3].outputs) == 3
    for out in (squeezed[0], squeezed[1], squeezed[3]):
        for o in out.outputs:
            assert o.finish_reason == "stop"
            jsonschema.validate(json.loads(o.text), SCHEMA)
    assert re.fullmatch(REGEX, squeezed[2].outputs[0].text)


def test_logprobs_min_tokens_and_ignore_eos_see_only_the_grammar(llm) -> None:
    engine = llm.llm_engine
    choices = ["yes", "no"]
    allowed = {engine.model_info.tokenizer.encode(c, add_special_tokens=False)[0] for c in choices}
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=1, logprobs=5, structured_outputs={"choice": choices}),
              SamplingParams(max_tokens=20, temperature=0, min_tokens=10, structured_outputs={"choice": choices}),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, structured_outputs={"choice": choices})]
    outs = run_checked(llm, PROMPTS[:3], params)
    first = outs[0].outputs[0].logprobs[0]
    finite = {t for t, lp in first.items() if lp.logprob > float("-inf")}
    assert finite <= allowed and outs[0].outputs[0].token_ids[0] in allowed
    assert abs(sum(torch.tensor(lp.logprob).exp().item() for t, lp in first.items() if t in allowed) - 1) < 1e-4 \
        or len(finite) == len(allowed)
    for out in outs:  # the grammar's end stops every one (min_tokens and ignore_eos do not outlast it)
        assert out.outputs[0].text in choices and out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("fields, message", [
    ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "structured_outputs.json is invalid"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"regex": "a(b"}, "structured_outputs.regex is invalid"),
    ({"grammar": 'root ::= "a" | '}, "structured_outputs.grammar is invalid"),
    ({"choice": []}, "structured_outputs.choice must be"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({}, "exactly one of"),
    ({"jsn": {}}, "unknown fields"),
])
def test_bad_constraints_are_value_errors_naming_the_field(llm, fields, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.llm_engine.add_request("bad", "x", SamplingParams(structured_outputs=fields))
    assert not llm.llm_engine.has_unfinished_requests()


def test_grammars_that_admit_nothing_or_reach_a_dead_end_are_errors_the_caller_sees(llm) -> None:
    """No first token: refused when added (the compile says so). A dead end later: the request
    ends with finish reason "error" and the reason, without the token the dead end forced; the
    request beside it runs to its end."""
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="admits no output"):
        engine.add_request("none", "x", SamplingParams(structured_outputs={"grammar": "root ::= root"}))
    engine.add_request("dead", "x", SamplingParams(max_tokens=8, structured_outputs={"grammar": 'root ::= "a" b\nb ::= b'}))
    engine.add_request("runs", "y", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step()})
    dead = done["dead"].outputs[0]
    assert dead.finish_reason == "error" and "dead end" in dead.error and dead.text == "a"
    assert len(done["runs"].outputs[0].token_ids) == 4
    assert not engine.engine_core.structured_output._matchers


def test_vocab_types() -> None:
    assert vocab_type({"decoder": {"type": "ByteLevel"}}) == (xgr.VocabType.BYTE_LEVEL, False)
    sentencepiece = {"decoder": {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}}
    assert vocab_type(sentencepiece) == (xgr.VocabType.BYTE_FALLBACK, True)
    sentencepiece["decoder"]["decoders"].pop()  # Gemma: no prefix space to strip
    assert vocab_type(sentencepiece) == (xgr.VocabType.BYTE_FALLBACK, False)
    assert vocab_type({"decoder": {"type": "WordPiece"}}) == (xgr.VocabType.RAW, False)
    assert vocab_type({"decoder": None}) == (xgr.VocabType.RAW, False)


def test_byte_fallback_tokenizer_end_to_end(tmp_path) -> None:
    """A SentencePiece-style vocabulary (▁ for spaces, <0xNN> byte pieces): constrained text with
    spaces and a character the vocabulary lacks comes out exact."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    from tools.tiny_checkpoint import make_checkpoint, training_corpus

    path = make_checkpoint(tmp_path / "sp", initializer_range=0.1)
    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    # trained without byte pieces, then rebuilt with <0x00>..<0xFF> in the vocabulary (as in
    # SentencePiece's tokenizer.json: ordinary tokens, not special ones)
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained.train_from_iterator(training_corpus(), trainers.BpeTrainer(
        vocab_size=vocab_size - 256, special_tokens=["<s>", "</s>", "<pad>"], show_progress=False))
    bpe = json.loads(trained.to_str())["model"]
    pieces = sorted(bpe["vocab"], key=bpe["vocab"].get)
    vocab = {t: i for i, t in enumerate(pieces[:3] + [f"<0x{b:02X}>" for b in range(256)] + pieces[3:])}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in bpe["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tok.normalizer = trained.normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    tok.save(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() <= vocab_size and tok.token_to_id("</s>") == 1
    assert tok.encode("Ω").tokens == ["▁", "<0xCE>", "<0xA9>"] and tok.decode(tok.encode("a Ω").ids) == "a Ω"
    llm = LLM(str(path), dtype="float32")
    choices = ["café au lait", "two words", "Ω"]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured_outputs={"choice": choices})
              for s in range(6)]
    params.append(SamplingParams(max_tokens=60, temperature=0.8, seed=1, structured_outputs={"regex": "[a-z]{2}( [a-z]{2}){2}"}))
    outs = run_checked(llm, ["Hello there"] * len(params), params)
    for out in outs[:-1]:
        assert out.outputs[0].text in choices
    assert re.fullmatch("[a-z]{2}( [a-z]{2}){2}", outs[-1].outputs[0].text)


@pytest.mark.parametrize("num_rows, vocab, rows", [(32, 49152, list(range(32))), (5, 1000, [4, 0, 2]), (3, 33, [1]),
                                                   (2, 64, [])])
def test_bitmask_kernel_equals_the_reference(num_rows, vocab, rows) -> None:
    from dabba.ops.native import load_cpu_ops
    from dabba.worker.sampler import apply_grammar_bitmask, apply_grammar_bitmask_reference

    if not load_cpu_ops():
        pytest.skip("native kernels unavailable")
    g = torch.Generator().manual_seed(vocab)
    words = torch.randint(-2**31, 2**31 - 1, (len(rows), (vocab + 31) // 32), dtype=torch.int32, generator=g)
    if rows:
        words[0, : words.shape[1] // 2] = -1  # whole words allowed: the kernel's shortcut
    logits = torch.randn(num_rows, vocab, generator=g)
    native, reference = logits.clone(), logits.clone()
    apply_grammar_bitmask(native, words.numpy(), rows)
    apply_grammar_bitmask_reference(reference, words, torch.tensor(rows, dtype=torch.long))
    assert torch.equal(native, reference)
    untouched = [r for r in range(num_rows) if r not in rows]
    assert torch.equal(native[untouched], logits[untouched])
    for i, r in enumerate(rows):  # exactly the forbidden tokens are -inf
        bits = torch.tensor([(int(words[i, t // 32]) >> (t % 32)) & 1 for t in range(vocab)], dtype=torch.bool)
        assert torch.equal(native[r] == float("-inf"), ~bits)
