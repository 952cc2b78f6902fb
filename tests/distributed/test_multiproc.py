"""Tensor parallelism in worker processes (gloo between them), as users run it: the features that
change what a step holds (prefix caching, chunked prefill, preemption, quantized layers) give
the tokens of one rank; a rank that dies fails the requests in flight and the server says it is
unhealthy; splits that cannot work are refused before any process starts."""
from __future__ import annotations

import os

import httpx
import pytest

from dabba import LLM, SamplingParams
from dabba.executor.base import WorkerDiedError
from dabba.executor.multiproc import MultiprocExecutor
from tests.conftest import token_prompts
from tests.entrypoints.live_server import live_server
from tools.tiny_checkpoint import make_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
BLOCK_BYTES = 16 * 2 * 2 * 24 * 4  # a 16-token block of the tiny llama's 2 layers, one KV head, float32


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(token_prompts(prompts), params, use_tqdm=False)]


def test_prefix_caching_chunked_prefill_and_preemption_match_one_rank(checkpoints) -> None:
    ckpt = checkpoints["llama"]
    prompts = [ckpt.prompts[i] for i in (3, 5, 8, 10, 11)]  # the last two share 150 tokens with the third
    # the same 24 blocks either way: a rank holds one of the two KV heads, so half the bytes
    common = dict(dtype="float32", max_model_len=512, max_num_batched_tokens=48)
    whole = LLM(str(ckpt.path), kv_cache_memory=24 * 2 * BLOCK_BYTES, **common)
    split = LLM(str(ckpt.path), kv_cache_memory=24 * BLOCK_BYTES, tensor_parallel_size=2, **common)
    try:
        assert isinstance(split.llm_engine.engine_core.executor, MultiprocExecutor)
        assert generate(split, prompts) == generate(whole, prompts)
        stats, split_stats = whole.llm_engine.get_stats(), split.llm_engine.get_stats()
        assert stats.kv_blocks_total == split_stats.kv_blocks_total == 24
        assert stats.num_preemptions > 0 and split_stats.num_preemptions == stats.num_preemptions
        assert split_stats.prefix_cache_hit_tokens == stats.prefix_cache_hit_tokens > 0
        seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
        assert generate(split, prompts[:2], seeded) == generate(whole, prompts[:2], seeded)
    finally:
        split.llm_engine.shutdown()


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "olmoe"])  # dense, q/k/v bias, Gemma's norms, experts
def test_the_native_layer_loop_sums_over_the_ranks_as_the_python_layers_do(family, checkpoints) -> None:
    ckpt = checkpoints[family]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = token_prompts([ckpt.prompts[i] for i in (0, 3, 8, 10)])  # a decode batch and prompt chunks
    results = {}
    for loop in ("off", "on"):
        llm = LLM(str(ckpt.path), dtype="float32", max_num_batched_tokens=128, tensor_parallel_size=2,
                  native_layer_loop=loop)
        try:
            results[loop] = [(o.outputs[0].token_ids, [{t: p.logprob for t, p in d.items()} for d in o.outputs[0].logprobs])
                             for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.llm_engine.shutdown()
    assert results["on"] == results["off"]  # the same bits: the same kernels, sums in rank order


def test_a_draft_model_runs_whole_on_every_rank(checkpoints) -> None:
    ckpt = checkpoints["llama"]
    # the target as its own draft: every draft is accepted; fixed drafts: their counts do not depend on timing
    spec = {"model": str(ckpt.path), "num_speculative_tokens": 3, "adaptive_drafts": False}
    prompts = [p[:30] for p in ckpt.prompts[:4]]
    results = {}
    for size in (1, 2):
        llm = LLM(str(ckpt.path), dtype="float32", kv_cache_memory=2**22, speculative_config=spec,
                  tensor_parallel_size=size)
        try:
            stats = (generate(llm, prompts), llm.get_stats())
            results[size] = (stats[0], stats[1].spec_num_draft_tokens, stats[1].spec_num_accepted_tokens)
        finally:
            llm.llm_engine.shutdown()
    assert results[2] == results[1] and results[1][2] > 0  # the same tokens, drafts and acceptances
    assert results[1][0] == generate(LLM(str(ckpt.path), dtype="float32", kv_cache_memory=2**22), prompts)


@pytest.mark.parametrize("quantization", ["int8", "int4", "w8a8"])
def test_quantized_layers_shard_along_their_groups(quantization, checkpoints, tmp_path) -> None:
    # int4's groups of 128 need 128 input channels a rank: o_proj's 256, down_proj's 512; w8a8's
    # row-parallel shards round their slice of each row by the whole row's range (gathered)
    path = make_checkpoint(tmp_path / "wide", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, initializer_range=0.1)
    prompts = checkpoints["llama"].prompts[2:6]
    whole = LLM(str(path), dtype="float32", quantization=quantization)
    split = LLM(str(path), dtype="float32", quantization=quantization, tensor_parallel_size=2)
    try:
        assert generate(split, prompts) == generate(whole, prompts)
    finally:
        split.llm_engine.shutdown()


def test_a_shard_boundary_inside_a_group_is_refused(checkpoints) -> None:
    # the tiny llama's o_proj has 96 input channels, int4 groups of 32: 48 a rank splits a group
    with pytest.raises(ValueError, match="shard boundary inside a quantization group"):
        LLM(str(checkpoints["llama"].path), dtype="float32", quantization="int4", tensor_parallel_size=2)


def test_impossible_splits_are_refused_before_starting(checkpoints, monkeypatch) -> None:
    path = str(checkpoints["qwen2"].path)  # 6 heads
    with pytest.raises(ValueError, match="does not divide the model's 6 attention heads"):
        LLM(path, tensor_parallel_size=4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(ValueError, match="more than the 1 cores"):
        LLM(path, tensor_parallel_size=2)


def test_a_dead_rank_fails_requests_and_the_server_turns_unhealthy(checkpoints) -> None:
    with live_server(str(checkpoints["llama"].path), "tiny", None, tensor_parallel_size=2) as (url, engine):
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200
        engine.engine_core.executor.procs[1].kill()
        failed = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert failed.status_code == 503 and failed.json()["error"]["type"] == "server_error"
        assert httpx.get(f"{url}/health").status_code == 503
        with pytest.raises(WorkerDiedError, match="stopped earlier"):
            engine.engine_core.executor.execute_model(None)
