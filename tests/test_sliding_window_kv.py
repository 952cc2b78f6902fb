"""The KV cache stops paying for what no layer can see: a model with sliding-window and global
layers (here Qwen2 with use_sliding_window, layer 0 global, layers 1-2 sliding: three KV-cache
groups of one layer) generates what transformers generates in a cache too small to keep every
layer's whole context, on both attention backends and in the native layer loop."""
from __future__ import annotations

import pytest
import torch

from dabba import LLM, SamplingParams
from dabba.attention.kv_quant import kv_bytes_per_token
from dabba.core.kv_cache_groups import KVCacheGroup
from tests.conftest import INIT_STD, hf_greedy, make_prompts, run_checked, token_prompts
from tools.tiny_checkpoint import make_checkpoint

WINDOW = 24
NUM_NEW = 48
CHUNK = 32


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(tmp_path_factory.mktemp("qwen2_sliding"), "Qwen2ForCausalLM", initializer_range=INIT_STD,
                           num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    prompts = [p for p in make_prompts(model.config.vocab_size) if len(p) >= 16][:6]  # 16..191 tokens
    return path, prompts, hf_greedy(model, prompts, NUM_NEW)


def block_bytes(path) -> int:
    """One block of the shared pool: group size 1 layer, float32, 16 tokens, 2 KV heads of 24."""
    return 16 * kv_bytes_per_token(1, 2, 24, "auto", torch.float32)


@pytest.mark.parametrize("backend, native_loop", [("auto", "on"), ("auto", "off"), ("torch_ref", "off")])
def test_greedy_matches_transformers_in_a_cache_that_frees_passed_blocks(hybrid, backend, native_loop, dabba_log):
    path, prompts, reference = hybrid
    # The longest sequence (191 + 48 tokens) keeping all 3 layers' context: 3 x 15 = 45 blocks.
    # Freeing: 15 in the global group, at most cdiv(23 + 32, 16) + 1 = 5 in each sliding one.
    llm = LLM(str(path), dtype="float32", attention_backend=backend, native_layer_loop=native_loop,
              kv_cache_memory=26 * block_bytes(path), max_num_batched_tokens=CHUNK, max_model_len=256)
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.groups == (KVCacheGroup((0,), None), KVCacheGroup((1,), WINDOW), KVCacheGroup((2,), WINDOW))
    assert kv.num_usable_blocks == 25 and kv.blocks_needed(191 + NUM_NEW - 1) == 25
    assert any("3 groups of 1 layers, 2 of them sliding-window" in r.getMessage() for r in dabba_log)
    outputs = run_checked(llm, token_prompts(prompts), SamplingParams(max_tokens=NUM_NEW, temperature=0,
                                                                       ignore_eos=True))
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        assert out.outputs[0].token_ids == ref, f"prompt {i} (len {len(prompts[i])}) diverges"


def test_a_long_sequence_holds_a_window_of_blocks_in_sliding_groups(hybrid):
    path, prompts, _ = hybrid
    llm = LLM(str(path), dtype="float32", kv_cache_memory=64 * block_bytes(path), max_num_batched_tokens=CHUNK,
              max_model_len=256)
    engine = llm.llm_engine
    kv = engine.engine_core.kv_cache_manager
    engine.add_request("long", {"prompt_token_ids": prompts[-1]},
                       SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True))
    most = [0, 0, 0]
    while engine.has_unfinished_requests():
        engine.step()
        kv.check_integrity()
        for g, ids in enumerate(kv.get_block_ids("long")):
            most[g] = max(most[g], sum(1 for b in ids if b != kv.pool.null_block.block_id))
    # The bound is cdiv(23 + 32, 16) + 1 = 5; the chunks (0, 32, .., 160, 191..) never straddle so badly.
    assert most == [15, 4, 4] and max(most[1:]) <= kv.groups[1].blocks_needed(238, 16, CHUNK)
