"""Logprobs of generated and prompt tokens against transformers' log-softmax of its logits."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dabba import LLM, SamplingParams
from tests.conftest import run_checked, token_prompts

ATOL = 1e-4


def hf_log_softmax(path, token_ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float().log_softmax(dim=-1)  # [len, vocab]


@pytest.mark.parametrize("name", ["llama", "qwen3", "phi3", "mixtral", "olmoe"])
@pytest.mark.parametrize("engine_kwargs", [dict(), dict(max_num_batched_tokens=24)], ids=["whole", "chunked"])
def test_logprobs_match_transformers(checkpoints, name, engine_kwargs) -> None:
    ckpt = checkpoints[name]
    prompts = [ckpt.prompts[i] for i in (2, 5, 7)]  # 7, 17 and 100 tokens
    llm = LLM(str(ckpt.path), dtype="float32", **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    outs = run_checked(llm, token_prompts(prompts), params)
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        ref = hf_log_softmax(ckpt.path, prompt + completion.token_ids)
        # generated token j is predicted at position len(prompt) + j - 1
        assert len(completion.logprobs) == len(completion.token_ids)
        for j, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = ref[len(prompt) + j - 1]
            assert position[token].rank == 1  # greedy picks the most likely token
            assert abs(position[token].logprob - row[token].item()) < ATOL
            top_lp, top_ids = row.topk(5)
            assert set(position) == set(top_ids.tolist())  # the sampled token is the top-1 itself
            for tid, lp in zip(top_ids.tolist(), top_lp.tolist()):
                assert abs(position[tid].logprob - lp) < ATOL
        assert completion.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(completion.token_ids,
                                                                                                completion.logprobs)))
        # prompt token i is predicted at position i - 1; the first has none
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            position = out.prompt_logprobs[i]
            row = ref[i - 1]
            assert abs(position[prompt[i]].logprob - row[prompt[i]].item()) < ATOL
            assert position[prompt[i]].rank == int((row > row[prompt[i]]).sum()) + 1
            top_lp, top_ids = row.topk(3)
            for tid, lp in zip(top_ids.tolist(), top_lp.tolist()):
                assert abs(position[tid].logprob - lp) < ATOL


def test_logprobs_are_the_raw_distribution_and_rank_the_sampled_token(checkpoints) -> None:
    """Temperature and penalties change what is sampled, not the reported logprobs."""
    ckpt = checkpoints["llama"]
    prompt = ckpt.prompts[4]
    llm = LLM(str(ckpt.path), dtype="float32")
    params = SamplingParams(temperature=1.5, repetition_penalty=1.5, seed=5, max_tokens=8, ignore_eos=True, logprobs=2)
    completion = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    ref = hf_log_softmax(ckpt.path, prompt + completion.token_ids)
    for j, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(prompt) + j - 1]
        assert abs(position[token].logprob - row[token].item()) < ATOL
        assert position[token].rank == int((row > row[token]).sum()) + 1
        assert len(position) in (2, 3)  # top 2, plus the sampled token when it is not among them
    assert any(p[t].rank > 1 for t, p in zip(completion.token_ids, completion.logprobs)), "never left the greedy path"


def test_prompt_logprobs_survive_preemption(checkpoints) -> None:
    from tests.test_parity import _bytes_per_block

    ckpt = checkpoints["llama"]
    prompts = ckpt.prompts[6:]
    llm = LLM(str(ckpt.path), dtype="float32", kv_cache_memory=30 * _bytes_per_block(ckpt.path))
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, prompt_logprobs=0)
    outs = run_checked(llm, token_prompts(prompts), params)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        ref = hf_log_softmax(ckpt.path, prompt)
        got = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
        want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert torch.allclose(got, want, atol=ATOL)
        assert all(len(p) == 1 for p in out.prompt_logprobs[1:])  # N = 0: just the prompt token
