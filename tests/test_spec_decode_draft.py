"""Speculative decoding with a draft model: refusals, greedy identity with plain decoding (under
chunked prefill, prefix caching, preemption and either layer loop), the draft's own KV cache kept
right through all of them, and rejection sampling keeping the target's distribution.

Two drafts of the "llama" checkpoint: the checkpoint itself, which must have every draft accepted
(its KV cache, written through the target's block tables, lookahead slots and rollbacks, must hold
exactly what the target's holds, or its proposals would differ); and its first layer alone
(tools/tiny_checkpoint.first_layers), which agrees with the target some of the time, so that
acceptance, rejection and the residual draw all happen."""
from __future__ import annotations

import json

import pytest
import torch

from dabba import LLM, SamplingParams
from tests.conftest import run_checked, token_prompts
from tests.test_spec_decode import assert_keeps_the_distribution, repetitive_prompts
from tools.tiny_checkpoint import first_layers, make_checkpoint


@pytest.fixture(scope="module")
def drafts(checkpoints, tmp_path_factory) -> dict[str, str]:
    target = checkpoints["llama"].path
    return {"self": str(target), "one_layer": str(first_layers(target, tmp_path_factory.mktemp("draft") / "d", 1))}


def spec(draft: str, k: int = 3) -> dict:
    """Fixed drafts: the tests count drafts, which adaptive drafts (the default) tie to timing."""
    return {"model": draft, "num_speculative_tokens": k, "adaptive_drafts": False}


def test_bad_drafts_are_refused(checkpoints, drafts, tmp_path) -> None:
    target = str(checkpoints["llama"].path)
    other_size = make_checkpoint(tmp_path / "vocab", vocab_size=500, num_hidden_layers=1)
    with pytest.raises(ValueError, match="vocabulary of 500 tokens and the target 1024"):
        LLM(target, kv_cache_memory=2**22, speculative_config=spec(str(other_size)))
    other_tokenizer = first_layers(target, tmp_path / "tokenizer", 1)  # the same size, two tokens' ids swapped
    tokenizer = json.loads((other_tokenizer / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other_tokenizer / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="tokenizer maps tokens to other ids"):
        LLM(target, kv_cache_memory=2**22, speculative_config=spec(str(other_tokenizer)))
    windowed = make_checkpoint(tmp_path / "window", "MistralForCausalLM", num_hidden_layers=1, sliding_window=8)
    with pytest.raises(ValueError, match="sliding-window layers"):
        LLM(target, kv_cache_memory=2**22, speculative_config=spec(str(windowed)))
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1"):
        LLM(target, kv_cache_memory=2**22, speculative_config={"model": target, "num_speculative_tokens": 0})


def generate_both(target, prompts, params, speculative_config, **options) -> tuple[list, list, object]:
    plain = LLM(str(target), dtype="float32", kv_cache_memory=2**22, **options)
    with_draft = LLM(str(target), dtype="float32", kv_cache_memory=2**22, speculative_config=speculative_config,
                     **options)
    outs = [run_checked(llm, token_prompts(prompts), params) for llm in (plain, with_draft)]
    return outs[0], outs[1], with_draft.get_stats()


@pytest.mark.parametrize("draft, options", [
    ("self", {}),
    ("self", {"max_num_batched_tokens": 24}),  # chunked prefill: the draft catches up chunk by chunk
    ("one_layer", {"max_num_batched_tokens": 24}),
    ("one_layer", {"enable_prefix_caching": False, "native_layer_loop": "off"}),
])
def test_greedy_tokens_and_logprobs_match_plain_decoding(checkpoints, drafts, draft, options) -> None:
    ckpt = checkpoints["llama"]
    prompts = [p[:30] for p in ckpt.prompts[:6]] + repetitive_prompts(ckpt, 4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    plain, spec_out, stats = generate_both(ckpt.path, prompts, params, spec(drafts[draft]), **options)
    assert [o.outputs[0].token_ids for o in spec_out] == [o.outputs[0].token_ids for o in plain]
    for a, b in zip(plain, spec_out):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert list(x) == list(y) and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    assert stats.spec_num_draft_tokens > 0
    if draft == "self":
        assert stats.spec_acceptance_rate == 1.0 and stats.spec_mean_accepted_length > 3.5
    else:
        assert 0 < stats.spec_acceptance_rate < 1


def test_load_time_quantization_applies_to_the_draft_too(checkpoints, drafts) -> None:
    ckpt = checkpoints["llama"]
    prompts = repetitive_prompts(ckpt, 4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(str(ckpt.path), dtype="float32", kv_cache_memory=2**22, quantization="int8")
    with_draft = LLM(str(ckpt.path), dtype="float32", kv_cache_memory=2**22, quantization="int8",
                     speculative_config=spec(drafts["self"]))
    outs = [run_checked(llm, token_prompts(prompts), params) for llm in (plain, with_draft)]
    assert [o.outputs[0].token_ids for o in outs[1]] == [o.outputs[0].token_ids for o in outs[0]]
    draft = with_draft.llm_engine.engine_core.model_runner.proposer.model
    assert any(b.dtype == torch.int8 for b in draft.buffers())  # its linear layers were rounded too
    assert with_draft.get_stats().spec_acceptance_rate == 1.0  # the draft is the target, rounded the same way


def test_preemption_and_prefix_sharing_keep_the_drafts_cache(checkpoints, drafts) -> None:
    """Requests preempted and resumed, a shared prefix served from the cache to later requests:
    the draft reads its KV for those blocks through the same tables, so a self-draft still has
    every token accepted."""
    ckpt = checkpoints["llama"]
    shared = ckpt.prompts[8][:48]
    prompts = [shared + p[:20] for p in repetitive_prompts(ckpt, 8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    options = {"max_num_seqs": 8, "block_size": 16, "dtype": "float32"}
    sizing = LLM(str(ckpt.path), kv_cache_memory=2**22, speculative_config=spec(drafts["self"]), **options)
    bytes_per_block = sizing.llm_engine.engine_core.cache_layout.bytes_per_block
    small = 3 * 10 * bytes_per_block  # about three requests' worth, for eight
    plain = LLM(str(ckpt.path), kv_cache_memory=small, **options)
    with_draft = LLM(str(ckpt.path), kv_cache_memory=small, speculative_config=spec(drafts["self"]), **options)
    outs = [run_checked(llm, token_prompts(prompts), params) for llm in (plain, with_draft)]
    assert [o.outputs[0].token_ids for o in outs[1]] == [o.outputs[0].token_ids for o in outs[0]]
    stats = with_draft.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    assert stats.spec_acceptance_rate == 1.0


def test_a_prefix_hit_on_blocks_the_draft_never_saw_is_recomputed(checkpoints, drafts) -> None:
    """A structured-output request never speculates, so the draft never writes its blocks; a later
    request that hits them in the prefix cache must not read the draft's KV there as written."""
    ckpt = checkpoints["llama"]
    prompt = [t for p in ckpt.prompts for t in p][:64]
    llm = LLM(str(ckpt.path), dtype="float32", kv_cache_memory=2**22, speculative_config=spec(drafts["self"]))
    constrained = SamplingParams(temperature=0, max_tokens=6, structured_outputs={"regex": "(ab){3}"})
    run_checked(llm, token_prompts([prompt]), constrained)
    assert llm.get_stats().spec_num_draft_tokens == 0
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    run_checked(llm, token_prompts([prompt + [7, 8, 9]]), greedy)
    stats = llm.get_stats()
    assert stats.prefix_cache_hit_tokens >= 48 and stats.spec_num_draft_tokens > 0
    assert stats.spec_acceptance_rate == 1.0


def test_the_drafts_cache_takes_its_share_of_the_budget(checkpoints, drafts) -> None:
    ckpt = checkpoints["llama"]
    plain = LLM(str(ckpt.path), dtype="float32", kv_cache_memory=2**22).llm_engine.engine_core.cache_layout
    half = LLM(str(ckpt.path), dtype="float32", kv_cache_memory=2**22,
               speculative_config=spec(drafts["one_layer"])).llm_engine.engine_core.cache_layout
    assert 2 * half.bytes_per_block == 3 * plain.bytes_per_block  # two layers, and the draft's one
    assert half.num_blocks == 2**22 // half.bytes_per_block


def test_seeded_sampling_is_reproducible_in_any_batch(checkpoints, drafts) -> None:
    """A seeded request's draws (draft, acceptance, residual, bonus) are keyed on (seed, output
    index): the same text alone or beside other requests, with penalties and min_tokens."""
    ckpt = checkpoints["llama"]
    prompts = repetitive_prompts(ckpt, 6)
    params = [SamplingParams(temperature=0.8, top_k=30, seed=i, max_tokens=24, ignore_eos=True,
                             repetition_penalty=1.1 if i % 2 else 1.0, min_tokens=4 if i % 3 == 0 else 0)
              for i in range(len(prompts))]
    llm = LLM(str(ckpt.path), dtype="float32", kv_cache_memory=2**22, speculative_config=spec(drafts["one_layer"]))
    together = run_checked(llm, token_prompts(prompts), params)
    alone = [run_checked(llm, token_prompts([p]), [q])[0] for p, q in zip(prompts[:3], params[:3])]
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in together[:3]]
    stats = llm.get_stats()
    assert 0 < stats.spec_acceptance_rate < 1


def test_rejection_sampling_keeps_the_targets_distribution(tmp_path) -> None:
    """An 8-token target and its first layer as the draft (q differs from p), sampled with and
    without it (tests/test_spec_decode.assert_keeps_the_distribution)."""
    target = make_checkpoint(tmp_path / "tiny-vocab", vocab_size=8, hidden_size=32, intermediate_size=64,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, initializer_range=0.3)
    draft = first_layers(target, tmp_path / "draft", 1)
    assert_keeps_the_distribution(target, spec(str(draft)), max_acceptance=0.95)


def test_the_cli_takes_a_draft_model(checkpoints, drafts, capsys) -> None:
    from dabba.entrypoints.cli import main

    ckpt = checkpoints["llama"]
    config = json.dumps(spec(drafts["self"], 2))
    assert main(["generate", str(ckpt.path), "--prompt", "hello", "--max-tokens", "6", "--temperature", "0",
                 "--speculative-config", config]) == 0
    assert capsys.readouterr().out.strip()


def test_the_benchmark_runs_a_draft_model_on_held_out_text(checkpoints, drafts, tmp_path) -> None:
    from benchmarks.spec_decode import run

    target = first_layers(checkpoints["llama"].path, tmp_path / "target", 2)  # a copy, given held-out text
    (target / "heldout.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    result = run(str(target), "heldout", batch_size=2, input_len=24, output_len=10, num_speculative_tokens=3,
                 rounds=1, draft=drafts["self"], adaptive_drafts=False)
    prompts = result.pop("prompts")
    assert [len(p) for p in prompts] == [24, 24] and prompts[0] != prompts[1]
    assert result["same_tokens"] is True and result["speculative_config"]["model"] == drafts["self"]
    assert result["spec_decode"]["acceptance_rate"] == 1.0
