"""Sampling: each filter against transformers' own warpers, frequencies against the
distribution (chi-square), penalties and logit_bias on known vectors, min_tokens, n > 1."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from dabba import LLM, SamplingParams
from dabba.ops import native
from dabba.worker.request_states import CachedRequestState
from dabba.worker.sampler import Sampler, apply_min_p, argmax_rows, apply_penalties, apply_top_k, apply_top_p
from dabba.worker.sampling_metadata import build_sampling_metadata
from tests.conftest import run_checked, token_prompts

FILTERS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 5, 1.0, 0.0),
    (0.8, -1, 0.7, 0.0),
    (1.3, -1, 1.0, 0.2),
    (0.7, 20, 0.9, 0.05),
    (1.0, 3, 0.5, 0.5),
]


def state(token_ids: list[int], num_prompt: int, params: SamplingParams, rid: str = "r") -> CachedRequestState:
    return CachedRequestState(rid, list(token_ids), params, 0, num_prompt, frozenset({1}))


def hf_allowed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p > 0:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return torch.isfinite(scores)


@pytest.fixture(scope="module")
def hf_last_logits(checkpoints) -> tuple[object, list[list[int]], torch.Tensor]:
    ckpt = checkpoints["llama"]
    model = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).eval()
    prompts = ckpt.prompts[2:7]
    with torch.inference_mode():
        logits = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])
    return ckpt, prompts, logits  # [num_prompts, vocab]


def test_filters_keep_exactly_the_tokens_transformers_keeps(hf_last_logits) -> None:
    _, _, logits = hf_last_logits
    rows = [logits[i % len(logits)] for i in range(len(FILTERS))]
    batch = torch.stack(rows)
    # every row has its own settings, all filtered in one batched call
    t = torch.tensor([f[0] for f in FILTERS])
    ours = batch / t[:, None]
    ours = apply_top_k(ours, torch.tensor([f[1] if f[1] > 0 else batch.shape[1] for f in FILTERS]))
    ours = apply_top_p(ours, torch.tensor([f[2] for f in FILTERS]))
    ours = apply_min_p(ours, torch.tensor([f[3] for f in FILTERS]))
    for row, f in zip(range(len(FILTERS)), FILTERS):
        expected = hf_allowed(batch[row:row + 1], *f)[0]
        assert torch.equal(torch.isfinite(ours[row]), expected), f"filter {f}"
        assert 1 <= int(expected.sum()) < batch.shape[1]  # the filter really removed something


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", FILTERS)
def test_engine_samples_only_allowed_tokens(hf_last_logits, temperature, top_k, top_p, min_p) -> None:
    ckpt, prompts, logits = hf_last_logits
    allowed = set(torch.nonzero(hf_allowed(logits[0:1], temperature, top_k, top_p, min_p)[0]).flatten().tolist())
    llm = LLM(str(ckpt.path), dtype="float32")
    params = SamplingParams(n=200, max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=0)
    out = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)[0]
    first_tokens = [o.token_ids[0] for o in out.outputs]
    assert set(first_tokens) <= allowed
    assert len(set(first_tokens)) > 1 or len(allowed) == 1


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the allowed set was sampled"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}


@pytest.mark.parametrize("params, kept", [
    (dict(), [0, 1, 2, 3, 4]),
    (dict(top_k=3), [2, 3, 4]),
    (dict(top_p=0.6), [3, 4]),  # ascending cumulative .05 .15 .30 <= 0.4 are dropped
    (dict(min_p=0.35), [3, 4]),  # below 0.35 * 0.5
    (dict(temperature=0.5), [0, 1, 2, 3, 4]),
])
def test_frequencies_follow_the_distribution(params, kept) -> None:
    probs = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.50])
    num_rows = 20000
    p = SamplingParams(**{"temperature": 1.0, **params})
    md = build_sampling_metadata([state([0], 1, p)] * num_rows, 5, torch.device("cpu"))
    sampled = Sampler(torch.device("cpu"), seed=1234)(probs.log().repeat(num_rows, 1), md).sampled
    counts = torch.bincount(sampled, minlength=5).float()
    target = probs ** (1 / p.temperature)
    target = torch.zeros(5).index_copy(0, torch.tensor(kept), target[kept])
    target /= target.sum()
    stat = chi_square(counts, target)
    assert stat < CHI2_CRIT[len(kept) - 1], f"chi-square {stat:.2f} for {params}: counts {counts.tolist()}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1000, 151936])
def test_greedy_argmax_equals_torch_max_on_ties_nans_and_infinities(dtype, vocab) -> None:
    """The native one-pass argmax (bf16 read as it is) against torch.max(dim=-1): the first of
    equal maxima, a row's first NaN, infinities, and tails shorter than a vector."""
    torch.manual_seed(vocab)
    x = torch.randn(6, vocab).to(dtype)
    x[1] = 0.5  # every index ties
    x[2, vocab // 2] = x[2, -1] = float("nan")
    x[3, vocab // 3] = x[3, -1] = float("inf")
    x[4] = float("-inf")
    x[5, -1] = x[5].max() + 1  # the maximum in the tail
    reference = x.max(dim=-1).indices
    assert torch.equal(argmax_rows(x), reference)
    if native.load_cpu_ops():
        assert torch.equal(torch.ops.dabba_cpu.argmax_rows(x), reference)
        if vocab > 1:  # rows with a stride longer than themselves
            assert torch.equal(torch.ops.dabba_cpu.argmax_rows(x[:, :-1]), x[:, :-1].max(dim=-1).indices)


def test_penalties_follow_their_definitions() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 0.0]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    md = build_sampling_metadata([state([0, 3, 1, 1, 2], 2, p)], 5, torch.device("cpu"))
    # repetition on prompt+output tokens {0, 1, 2, 3}: 2/2, -1*2, .5/2, -.5*2; token 4 untouched.
    # then output counts {1: 2, 2: 1}: frequency -0.5 * count, presence -0.25 once.
    expected = torch.tensor([[1.0, -2.0 - 1.0 - 0.25, 0.25 - 0.5 - 0.25, -1.0, 0.0]])
    assert torch.equal(apply_penalties(logits, md), expected)


def test_logit_bias_and_min_tokens_ban_in_the_sampler() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0]])
    md = build_sampling_metadata([state([3], 1, SamplingParams(temperature=0, logit_bias={2: 10.0}))], 4,
                                 torch.device("cpu"))
    assert Sampler(torch.device("cpu"), 0)(logits, md).sampled.tolist() == [2]
    # eos (1) is the greedy token, but before min_tokens it cannot be sampled
    md = build_sampling_metadata([state([3], 1, SamplingParams(temperature=0, min_tokens=2))], 4, torch.device("cpu"))
    assert Sampler(torch.device("cpu"), 0)(logits, md).sampled.tolist() == [2]
    md = build_sampling_metadata([state([3, 2, 2], 1, SamplingParams(temperature=0, min_tokens=2))], 4,
                                 torch.device("cpu"))
    assert Sampler(torch.device("cpu"), 0)(logits, md).sampled.tolist() == [1]


def test_logit_bias_steers_greedy_decoding(checkpoints) -> None:
    ckpt = checkpoints["qwen2"]
    llm = LLM(str(ckpt.path), dtype="float32")
    out = llm.generate({"prompt_token_ids": ckpt.prompts[4]},
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={77: 100.0}),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [77] * 8


def test_min_tokens_postpones_stop_tokens(checkpoints) -> None:
    ckpt = checkpoints["llama"]
    ref = ckpt.reference[5]
    stop = ref[1]
    llm = LLM(str(ckpt.path), dtype="float32")
    early = llm.generate({"prompt_token_ids": ckpt.prompts[5]},
                         SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop]), use_tqdm=False)[0]
    assert early.outputs[0].token_ids == ref[: ref.index(stop) + 1]
    late = llm.generate({"prompt_token_ids": ckpt.prompts[5]},
                        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop], min_tokens=10),
                        use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) > 10 and stop not in late.token_ids[:10]
    assert late.finish_reason == "length" or (late.token_ids[-1] == stop and late.stop_reason == stop)


def test_n_samples_share_the_prompt_blocks(checkpoints) -> None:
    ckpt = checkpoints["llama"]
    prompt = ckpt.prompts[6]  # 64 tokens: 4 full blocks, the last recomputed per sample
    llm = LLM(str(ckpt.path), dtype="float32")
    engine = llm.llm_engine
    engine.add_request("p", {"prompt_token_ids": prompt}, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12))
    engine.step()
    tables = [engine.engine_core.kv_cache_manager.get_block_ids(f"p#{i}")[0] for i in range(4)]
    assert len({tuple(t[:3]) for t in tables}) == 1, tables  # the first 3 full blocks are one copy
    assert all(engine.engine_core.kv_cache_manager.pool.blocks[b].ref_cnt == 4 for b in tables[0][:3])
    assert len({t[3] for t in tables}) == 4  # the block holding the last prompt token is each sample's own
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert len(outs) == 1 and [o.index for o in outs[0].outputs] == [0, 1, 2, 3]
    samples = [tuple(o.token_ids) for o in outs[0].outputs]
    assert len(set(samples)) > 1 and all(len(s) == 12 for s in samples)
    # sample i is seeded with seed + i: alone, seed 4 reproduces sample 1
    alone = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=1.0, seed=4, max_tokens=12),
                         use_tqdm=False)[0]
    assert tuple(alone.outputs[0].token_ids) == samples[1]


def test_seeded_sampling_with_filters_and_penalties_ignores_the_batch(checkpoints) -> None:
    ckpt = checkpoints["qwen3"]
    llm = LLM(str(ckpt.path), dtype="float32")
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.2,
                            frequency_penalty=0.3, presence_penalty=0.2, seed=11, max_tokens=24)
    alone = llm.generate({"prompt_token_ids": ckpt.prompts[5]}, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.5, max_tokens=30), params, SamplingParams(temperature=0, max_tokens=3)]
    batch = run_checked(llm, token_prompts([ckpt.prompts[7], ckpt.prompts[5], ckpt.prompts[2]]), others)
    assert batch[1].outputs[0].token_ids == alone


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), r"temperature must be a number in \[0, 100\]"),
    (dict(temperature=float("inf")), r"temperature must be a number in \[0, 100\]"),
    (dict(temperature=float("nan")), r"temperature must be a number in \[0, 100\]"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=0), r"top_k must be -1 \(disabled\) or an integer in \[1, 2147483647\]"),
    (dict(top_k=2**31), r"top_k must be -1 \(disabled\) or an integer in \[1, 2147483647\]"),
    (dict(top_k=-2), r"top_k must be -1"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(n=0), r"n must be an integer >= 1"),
    (dict(max_tokens=0), r"max_tokens must be an integer >= 1"),
    (dict(min_tokens=5, max_tokens=3), r"min_tokens must be <= max_tokens \(3\)"),
    (dict(presence_penalty=3), r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=-2.5), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(repetition_penalty=0), r"repetition_penalty must be in \(0, 10\]"),
    (dict(repetition_penalty=float("inf")), r"repetition_penalty must be in \(0, 10\]"),
    (dict(presence_penalty=float("nan")), r"presence_penalty must be in \[-2, 2\]"),
    (dict(logit_bias={5: 200}), r"logit_bias must be biases in \[-100, 100\]"),
    (dict(logit_bias={-1: 1.0}), r"logit_bias must be keyed by token ids >= 0"),
    (dict(stop=[""]), r"stop must be non-empty strings"),
    (dict(logprobs=21), r"logprobs must be None or an integer in \[0, 20\]"),
    (dict(prompt_logprobs=-1), r"prompt_logprobs must be None or an integer in \[0, 20\]"),
    (dict(seed=1.5), r"seed must be None or an integer in \[-2\*\*63, 2\*\*64 - n\)"),
    (dict(seed=2**64), r"seed must be None or an integer"),
    (dict(seed=-(2**63) - 1), r"seed must be None or an integer"),
    (dict(output_kind=1), r"output_kind must be a RequestOutputKind, got 1"),
])
def test_invalid_values_name_the_field_and_range(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_token_ids_beyond_the_vocabulary_are_rejected(checkpoints) -> None:
    llm = LLM(str(checkpoints["llama"].path), dtype="float32")
    with pytest.raises(ValueError, match=r"logit_bias must be keyed by token ids in \[0, 1024\)"):
        llm.generate("hi", SamplingParams(logit_bias={5000: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match=r"stop_token_ids must be token ids in \[0, 1024\)"):
        llm.generate("hi", SamplingParams(stop_token_ids=[1024]), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
