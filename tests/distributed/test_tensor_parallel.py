"""Tensor parallelism: every family's shards at tp=2 give the greedy tokens of the whole model
(float32), through the real layers and runners with in-process collectives (thread_group.py);
start-up refuses the splits the layers cannot make."""
from __future__ import annotations

import pytest

from dabba import LLM, SamplingParams
from dabba.distributed.tensor_parallel import KVHeadShard, check_split
import dabba.engine.core as engine_core
from tests.conftest import token_prompts
from tests.distributed.thread_group import ThreadExecutor
from tools.tiny_checkpoint import make_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture
def threaded(monkeypatch):
    """LLM(tensor_parallel_size=N) runs its ranks as threads of this process."""
    executors = []

    def make(args, parallel, replica=0):
        if parallel.tensor_parallel_size == 1:
            return original(args, parallel, replica)
        executors.append(ThreadExecutor(args, parallel.tensor_parallel_size))
        return executors[-1]

    original = engine_core.make_executor
    monkeypatch.setattr(engine_core, "make_executor", make)
    yield executors
    for executor in executors:
        executor.shutdown()


# Phi-3's and Gemma 3's test checkpoints have 3 attention heads: tp=2 takes a 4-head variant.
FOUR_HEADS = {"phi3": dict(num_attention_heads=4, hidden_size=128), "gemma3": dict(num_attention_heads=4)}


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(token_prompts(prompts), GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral",
                                    "qwen3moe", "olmoe"])
def test_tp2_matches_tp1_every_family(family, checkpoints, threaded, tmp_path):
    from tests.conftest import CHECKPOINTS, INIT_STD

    ckpt = checkpoints[family]
    path = ckpt.path
    if family in FOUR_HEADS:
        spec = {**CHECKPOINTS[family], **FOUR_HEADS[family]}
        path = make_checkpoint(tmp_path / family, spec.pop("arch"), initializer_range=INIT_STD, **spec)
    prompts = ckpt.prompts[2:6]
    whole = generate(LLM(str(path), dtype="float32", max_model_len=512), prompts)
    split = LLM(str(path), dtype="float32", max_model_len=512, tensor_parallel_size=2)
    assert generate(split, prompts) == whole
    assert threaded[0].group.calls > 0  # the ranks did exchange partial results


def test_kv_heads_split_or_replicated():
    assert [KVHeadShard.of(r, 2, 4) for r in range(2)] == [KVHeadShard(0, 2), KVHeadShard(2, 2)]
    assert [KVHeadShard.of(r, 4, 2) for r in range(4)] == [KVHeadShard(0, 1), KVHeadShard(0, 1), KVHeadShard(1, 1),
                                                           KVHeadShard(1, 1)]
    with pytest.raises(ValueError, match="does not divide the model's 6 attention heads"):
        check_split(4, 6, 2)
    with pytest.raises(ValueError, match="not a multiple of them"):
        check_split(3, 6, 2)
    with pytest.raises(ValueError, match="does not divide the model's 4 KV heads"):
        check_split(3, 6, 4)


def wide_checkpoint(tmp_path):
    """Groups of 32 (the int4 kernel's smallest) fit a rank's half: o_proj's 128 input channels, 64
    a rank; down_proj's 256, 128."""
    return make_checkpoint(tmp_path / "wide", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, initializer_range=0.1)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_prequantized_checkpoints_shard_along_their_groups(fmt, checkpoints, threaded, tmp_path):
    from tests.quantization.test_gptq_checkpoint import write_awq_pair, write_gptq_pair

    path = wide_checkpoint(tmp_path)
    if fmt == "gptq":
        write_gptq_pair(path, tmp_path / fmt, tmp_path / "dequant", 32, act_order=False)
    else:
        write_awq_pair(path, tmp_path / fmt, tmp_path / "dequant", 32)
    prompts = checkpoints["llama"].prompts[2:6]
    whole = generate(LLM(str(tmp_path / fmt), dtype="float32"), prompts)
    assert generate(LLM(str(tmp_path / fmt), dtype="float32", tensor_parallel_size=2), prompts) == whole


def test_act_order_gptq_cannot_split_input_channels(threaded, tmp_path):
    from tests.quantization.test_gptq_checkpoint import write_gptq_pair

    write_gptq_pair(wide_checkpoint(tmp_path), tmp_path / "gptq", tmp_path / "dequant", 32, act_order=True)
    with pytest.raises(ValueError, match="act-order GPTQ checkpoint"):
        LLM(str(tmp_path / "gptq"), dtype="float32", tensor_parallel_size=2)
