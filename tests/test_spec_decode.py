"""Speculative decoding with n-gram proposals: the proposer's search, the configuration and its
refusals, and losslessness end to end. Greedy requests, and seeded sampled ones (whose noise
depends only on (seed, output index)), must give exactly the tokens a plain engine gives: under
chunked prefill, prefix caching, preemption and mixed batches, with penalties, min_tokens, stop
tokens, stop strings and max_tokens landing inside an accepted run; unseeded sampled ones the same
distribution (a chi-square test on an 8-token model). run_checked checks the KV cache after every
step; the engine's counters prove drafts were proposed and accepted."""
from __future__ import annotations

import pytest

from dabba import LLM, SamplingParams
from dabba.config import SpeculativeConfig
from dabba.worker.spec_decode.ngram import NgramProposer, PackedTokens
from dabba.worker.spec_decode.verification import accepted_tokens
from tests.conftest import run_checked, token_prompts

# Fixed drafts: the tests count drafts, which adaptive drafts (the default) would tie to timing.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive_drafts": False}


def packed(ids: list[int]) -> PackedTokens:
    tokens = PackedTokens()
    tokens.sync(ids)
    return tokens


def test_the_proposal_follows_the_latest_longest_match() -> None:
    proposer = NgramProposer(3, 1, 3)
    assert proposer.lookup(packed([1, 2, 3, 4, 5, 9, 1, 2, 3]), 10) == [4, 5, 9]
    # the most recent earlier occurrence wins: "2 3" was followed by 7 last time
    assert proposer.lookup(packed([2, 3, 4, 2, 3, 7, 8, 2, 3]), 10) == [7, 8, 2]
    assert proposer.lookup(packed([1, 2, 3, 4, 5, 9, 1, 2, 3]), 2) == [4, 5]  # the limit caps it
    assert proposer.lookup(packed([5, 6, 7, 8]), 10) == []  # nothing recurs
    assert NgramProposer(3, 2, 3).lookup(packed([7, 1, 7]), 10) == []  # a 1-gram is below min_n
    # token 256 packs as bytes 00 01 00 00: a byte-level hit across two tokens is no match
    assert proposer.lookup(packed([0, 1, 0, 0, 9, 256]), 10) == []
    tokens = packed([1, 2, 1])
    tokens.sync([1, 2, 1, 2])  # grows with the request
    assert proposer.lookup(tokens, 10) == [1, 2, 1]  # "1 2" recurs with period 2: the proposal repeats it
    tokens.sync([4, 4])  # a request resent whole starts again
    assert list(tokens.ids) == [4, 4] and proposer.lookup(tokens, 10) == [4, 4, 4]
    assert proposer.lookup(packed([9, 5, 6, 7, 5, 6]), 10) == [7, 5, 6]  # period 3, from its start


def test_accepted_tokens_stop_at_the_first_disagreement() -> None:
    assert accepted_tokens([5], []) == [5]
    assert accepted_tokens([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted, and the one after
    assert accepted_tokens([5, 9, 7, 8], [5, 6, 7]) == [5, 9]
    assert accepted_tokens([4, 6, 7, 8], [5, 6, 7]) == [4]


@pytest.mark.parametrize("value, message", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "eagle"}, "unknown method 'eagle'"),
    ({"method": "ngram", "model": "/tmp/draft"}, '"model" is for method "draft_model", not "ngram"'),
    ({"method": "draft_model", "num_speculative_tokens": 3}, 'method "draft_model" needs "model"'),
    ({"num_speculative_token": 3}, r"unknown field\(s\) \['num_speculative_token'\]"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_max .2. must be >= prompt_lookup_min .4."),
    ("{not json", "speculative_config is not valid JSON"),
    ("[3]", "speculative_config must be a JSON object"),
    ({"adaptive_drafts": "yes"}, "adaptive_drafts must be true or false"),
])
def test_bad_configs_are_refused(checkpoints, value, message) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)
    with pytest.raises(ValueError, match=message):
        LLM(str(checkpoints["llama"].path), kv_cache_memory=2**22, speculative_config=value)


def repetitive_prompts(ckpt, count: int) -> list[list[int]]:
    """Prompts that repeat a span of themselves, as edits and quotations do: lookups find them."""
    prompts = []
    for i in range(count):
        base = ckpt.prompts[i % len(ckpt.prompts)]
        span = base[: 6 + i % 9]
        prompts.append((base[: 10 + 3 * i] + span * (2 + i % 3))[:120])
    return prompts


def generate_both(path, prompts, params, **options) -> tuple[list, list, object]:
    plain = LLM(str(path), dtype="float32", kv_cache_memory=2**22, **options)
    spec = LLM(str(path), dtype="float32", kv_cache_memory=2**22, speculative_config=NGRAM, **options)
    outs = [run_checked(llm, token_prompts(prompts), params) for llm in (plain, spec)]
    return outs[0], outs[1], spec.get_stats()


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 24},  # chunked prefill: drafts share steps with prompt chunks
    {"enable_prefix_caching": False},
    {"native_layer_loop": "off"},
])
def test_greedy_tokens_and_logprobs_match_plain_decoding(checkpoints, options) -> None:
    ckpt = checkpoints["llama"]
    prompts = repetitive_prompts(ckpt, 12)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    plain, spec, stats = generate_both(ckpt.path, prompts, params, **options)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    for a, b in zip(plain, spec):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert list(x) == list(y)  # the same top tokens, their logprobs within float32 noise
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
    assert 1 < stats.spec_mean_accepted_length <= 1 + NGRAM["num_speculative_tokens"]
    assert 0 < stats.spec_acceptance_rate <= 1


def test_adaptive_drafts_keep_greedy_outputs(checkpoints) -> None:
    """The default: each request's drafts per step follow measured step times (whatever they are,
    the tokens are plain decoding's)."""
    ckpt = checkpoints["llama"]
    prompts = repetitive_prompts(ckpt, 12)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLM(str(ckpt.path), dtype="float32", kv_cache_memory=2**22)
    adaptive = LLM(str(ckpt.path), dtype="float32", kv_cache_memory=2**22,
                   speculative_config={**NGRAM, "adaptive_drafts": True})
    outs = [run_checked(llm, token_prompts(prompts), params) for llm in (plain, adaptive)]
    assert [o.outputs[0].token_ids for o in outs[1]] == [o.outputs[0].token_ids for o in outs[0]]
    speculation = adaptive.llm_engine.engine_core.scheduler.speculation
    assert speculation.step_cost.fit() is not None  # it measured steps of several sizes


def test_preemption_and_prefix_sharing_keep_outputs(checkpoints) -> None:
    """A KV cache too small for the batch: requests are preempted (their drafts dropped) and
    resumed; the shared prompt prefix is cached once."""
    ckpt = checkpoints["llama"]
    shared = ckpt.prompts[8][:48]
    prompts = [shared + p[:20] for p in repetitive_prompts(ckpt, 8)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    options = {"max_num_seqs": 8, "block_size": 16}
    plain = LLM(str(ckpt.path), dtype="float32", kv_cache_memory=2**22, **options)
    bytes_per_block = plain.llm_engine.engine_core.cache_layout.bytes_per_block
    small = 3 * 10 * bytes_per_block  # about three requests' worth of blocks, for eight
    plain = LLM(str(ckpt.path), dtype="float32", kv_cache_memory=small, **options)
    spec = LLM(str(ckpt.path), dtype="float32", kv_cache_memory=small, speculative_config=NGRAM, **options)
    outs = [run_checked(llm, token_prompts(prompts), params) for llm in (plain, spec)]
    assert [o.outputs[0].token_ids for o in outs[1]] == [o.outputs[0].token_ids for o in outs[0]]
    stats = spec.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0


def test_seeded_sampling_with_every_feature_matches_plain_decoding(checkpoints) -> None:
    """Row j of a speculative step is sampled as the plain run samples output j: the same
    penalties, min_tokens ban and (seed, index) noise, so a seeded request's text is the same."""
    ckpt = checkpoints["llama"]
    prompts = repetitive_prompts(ckpt, 10)
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=i, max_tokens=32, ignore_eos=True,
                             repetition_penalty=1.1 if i % 2 else 1.0, presence_penalty=0.3 if i % 3 == 0 else 0.0,
                             min_tokens=5 if i % 4 == 0 else 0, logprobs=1)
              for i in range(len(prompts))]
    plain, spec, stats = generate_both(ckpt.path, prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert stats.spec_num_draft_tokens > 0


def test_stops_inside_an_accepted_run_cut_it_where_plain_decoding_stops(checkpoints) -> None:
    ckpt = checkpoints["llama"]
    prompts = repetitive_prompts(ckpt, 10)
    plain_llm = LLM(str(ckpt.path), dtype="float32", kv_cache_memory=2**22)
    free = run_checked(plain_llm, token_prompts(prompts), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    tokenizer = plain_llm.get_tokenizer()
    params = []
    for i, out in enumerate(free):  # stop at a token, or at text, that the free run reaches mid-way
        ids = out.outputs[0].token_ids
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ids[17]]))
        elif i % 3 == 1:
            text = tokenizer.decode(ids[:20])
            params.append(SamplingParams(temperature=0, max_tokens=40, stop=[text[-3:]] if text.strip() else None))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=7 + i, min_tokens=5, ignore_eos=True))
    plain, spec, stats = generate_both(ckpt.path, prompts, params)
    for a, b in zip(plain, spec):
        assert (b.outputs[0].token_ids, b.outputs[0].text, b.outputs[0].finish_reason, b.outputs[0].stop_reason) == (
            a.outputs[0].token_ids, a.outputs[0].text, a.outputs[0].finish_reason, a.outputs[0].stop_reason)
    assert stats.spec_num_accepted_tokens > 0


def test_structured_outputs_requests_do_not_speculate(checkpoints) -> None:
    ckpt = checkpoints["llama"]
    llm = LLM(str(ckpt.path), dtype="float32", kv_cache_memory=2**22, speculative_config=NGRAM)
    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs={"regex": "(ab){5}"})
    out = llm.generate(["abababab"], params, use_tqdm=False)[0]
    assert out.outputs[0].text == "ababababab"
    assert llm.get_stats().spec_num_draft_tokens == 0
    # beside requests that do speculate, in the same steps: the grammar's bitmask row is its own
    prompts = repetitive_prompts(ckpt, 4)
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLM(str(ckpt.path), dtype="float32", kv_cache_memory=2**22).generate(
        token_prompts(prompts), free, use_tqdm=False)
    outs = run_checked(llm, ["abababab"] + token_prompts(prompts), [params] + [free] * len(prompts))
    assert outs[0].outputs[0].text == "ababababab"
    assert [o.outputs[0].token_ids for o in outs[1:]] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_stats().spec_num_accepted_tokens > 0


def test_proposals_pause_after_drafts_keep_failing() -> None:
    from dabba.worker.request_states import SPEC_MAX_PAUSE, CachedRequestState

    state = CachedRequestState("r", [1, 2], SamplingParams(), 0, 2)
    pauses = []
    for accepted in (0, 0, 0, 0, 0, 1, 0):
        state.record_drafts(accepted)
        pauses.append(state.spec_pause)
        state.spec_pause = 0  # as if the pause ran out
    assert pauses == [0, 0, 2, 4, 8, 0, 0]  # an accepted token starts the count again
    for _ in range(20):
        state.record_drafts(0)
    assert state.spec_pause == SPEC_MAX_PAUSE


def test_the_benchmark_runs_both_engines_side_by_side(checkpoints) -> None:
    from benchmarks.spec_decode import run

    result = run(str(checkpoints["llama"].path), "grounded", batch_size=2, input_len=20, output_len=12,
                 num_speculative_tokens=3, rounds=1, adaptive_drafts=False, num_prompts=3, spread_lengths=True)
    prompts = result.pop("prompts")
    assert all(len(p) == 30 and p[20:] == p[:10] for p in prompts) and len(prompts) == 3  # 3 prompts, 2 slots
    lengths = [len(t) for t in result.pop("dabba_tokens")]
    assert len(set(lengths)) > 1 and all(6 <= n <= 18 for n in lengths)  # each its own length
    assert result["same_tokens"] is True and min(result["tok_s"]["spec"] + result["tok_s"]["plain"]) > 0
    assert result["spec_decode"]["num_draft_tokens"] > 0


def chi_square_p(a: "Counter", b: "Counter") -> float:
    """Two-sample chi-square test of homogeneity over the categories either sample has: the
    p-value of the hypothesis that both come from one distribution."""
    import torch

    cats = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for c in cats:
        total = a[c] + b[c]
        for count, n in ((a[c], na), (b[c], nb)):
            expected = total * n / (na + nb)
            stat += (count - expected) ** 2 / expected
    df = len(cats) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_unseeded_sampling_keeps_the_models_distribution(tmp_path) -> None:
    """A model of 8 tokens, sampled at temperature 1 without seeds (the shared generator, whose
    draws speculation consumes differently): 1536 samples of 4 tokens with and without n-gram
    drafts (assert_keeps_the_distribution)."""
    from tools.tiny_checkpoint import make_checkpoint

    path = make_checkpoint(tmp_path / "tiny-vocab", vocab_size=8, hidden_size=32, intermediate_size=64,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, initializer_range=0.3)
    assert_keeps_the_distribution(path, {**NGRAM, "prompt_lookup_min": 1}, max_acceptance=0.9)


def assert_keeps_the_distribution(path, speculative_config: dict, max_acceptance: float) -> None:
    """1536 samples of 4 tokens of an 8-token model at temperature 1, with and without speculation,
    each engine its own seed (samples drawn with the same noise would not be independent): each
    position's tokens and the first pairs pass a chi-square test of one distribution, and the same
    test tells temperature 1 from 0.7 (it has the power to fail)."""
    from collections import Counter

    prompts = [[3, 4, 5, 3, 4, 5, 3, 4, 6, 7][: 6 + i % 5] for i in range(12)]

    def samples(temperature: float, speculate: bool, seed: int) -> list[tuple[int, ...]]:
        llm = LLM(str(path), dtype="float32", kv_cache_memory=2**22, seed=seed,
                  speculative_config=speculative_config if speculate else None)
        params = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True, n=128)
        outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
        if speculate:
            stats = llm.get_stats()
            assert stats.spec_num_draft_tokens > 1000 and 0.1 < stats.spec_acceptance_rate < max_acceptance
        return [(i, *c.token_ids) for i, o in enumerate(outs) for c in o.outputs]

    def p_values(a: list, b: list) -> list[float]:
        per_position = [chi_square_p(Counter((s[0], s[j]) for s in a), Counter((s[0], s[j]) for s in b))
                        for j in range(1, 5)]
        return per_position + [chi_square_p(Counter(s[:3] for s in a), Counter(s[:3] for s in b))]

    plain, spec = samples(1.0, False, seed=1), samples(1.0, True, seed=2)
    assert min(p_values(plain, spec)) > 1e-3
    assert min(p_values(plain, samples(0.7, False, seed=3))) < 1e-3
