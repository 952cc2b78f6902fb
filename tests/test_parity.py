"""Greedy output equals transformers token for token, under every scheduling regime."""
from __future__ import annotations

import pytest
import torch

from dabba import LLM, SamplingParams
from tests.conftest import NUM_NEW_TOKENS, Checkpoint, run_checked, token_prompts

GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0, ignore_eos=True)


def assert_matches_reference(outputs, ckpt: Checkpoint) -> None:
    for i, (out, ref) in enumerate(zip(outputs, ckpt.reference)):
        assert out.outputs[0].token_ids == ref, f"{ckpt.name} prompt {i} (len {len(ckpt.prompts[i])}) diverges"
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("backend", ["torch_ref", "auto"])
def test_greedy_matches_transformers(checkpoint: Checkpoint, backend: str) -> None:
    llm = LLM(str(checkpoint.path), dtype="float32", attention_backend=backend)
    outputs = run_checked(llm, token_prompts(checkpoint.prompts), GREEDY)
    assert_matches_reference(outputs, checkpoint)
    # the two prompts sharing a 150-token prefix with another hit the prefix cache
    assert llm.llm_engine.engine_core.kv_cache_manager.prefix_stats.num_hit_tokens >= 2 * 144


def test_greedy_in_plain_pytorch(checkpoint: Checkpoint, monkeypatch) -> None:
    """Where the native kernels cannot be built, every layer falls back to plain PyTorch."""
    from dabba.ops import native

    monkeypatch.setattr(native, "load_cpu_ops", lambda: False)
    llm = LLM(str(checkpoint.path), dtype="float32")
    assert type(llm.llm_engine.engine_core.model_runner.backend).__name__ == "TorchRefBackend"
    calls = []
    monkeypatch.setattr(torch.ops, "dabba_cpu", _Recorder(calls), raising=False)
    assert_matches_reference(run_checked(llm, token_prompts(checkpoint.prompts), GREEDY), checkpoint)
    assert not calls, f"native kernels ran: {sorted(set(calls))}"


class _Recorder:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def __getattr__(self, name: str):
        self.calls.append(name)
        raise AssertionError(f"torch.ops.dabba_cpu.{name} called with native kernels disabled")


def test_greedy_without_prefix_caching(checkpoint: Checkpoint) -> None:
    llm = LLM(str(checkpoint.path), dtype="float32", enable_prefix_caching=False)
    outputs = run_checked(llm, token_prompts(checkpoint.prompts), GREEDY)
    assert_matches_reference(outputs, checkpoint)
    assert llm.llm_engine.engine_core.kv_cache_manager.prefix_stats.num_hit_tokens == 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_with_chunked_prefill(checkpoint: Checkpoint, prefix_caching: bool) -> None:
    llm = LLM(str(checkpoint.path), dtype="float32", max_num_batched_tokens=40, enable_prefix_caching=prefix_caching)
    engine = llm.llm_engine
    chunked = []
    original = engine.engine_core.model_runner.execute_model

    def spy(sched):
        chunked.extend(n for r, n in sched.num_scheduled_tokens.items() if 1 < n < len(checkpoint.prompts[int(r[1:])]))
        assert sched.total_num_scheduled_tokens <= 40
        return original(sched)

    engine.engine_core.model_runner.execute_model = spy
    outputs = run_checked(llm, token_prompts(checkpoint.prompts), GREEDY)
    assert_matches_reference(outputs, checkpoint)
    assert chunked, "no prompt was split into chunks"


def _bytes_per_block(path) -> int:
    from dabba.attention.kv_quant import kv_bytes_per_token
    from dabba.arch.config import ArchConfig

    arch = ArchConfig.from_hf(path)  # float32, block_size 16
    return 16 * kv_bytes_per_token(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, "auto", torch.float32)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_under_preemption(checkpoint: Checkpoint, prefix_caching: bool) -> None:
    # 30 blocks: the longest request alone needs 23 (300 + 64 tokens), all together need ~150.
    # (Models mixing sliding and global layers group their layers (core/kv_cache_groups.py): the
    # same memory then holds more blocks of fewer layers each.)
    llm = LLM(str(checkpoint.path), dtype="float32", kv_cache_memory=30 * _bytes_per_block(checkpoint.path),
              enable_prefix_caching=prefix_caching)
    layout = llm.llm_engine.engine_core.model_runner.layout
    assert layout.num_blocks * layout.bytes_per_block == 30 * _bytes_per_block(checkpoint.path)
    outputs = run_checked(llm, token_prompts(checkpoint.prompts), GREEDY)
    assert_matches_reference(outputs, checkpoint)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_the_mistral_reference_attends_within_its_sliding_window(checkpoints) -> None:
    """The suite's Mistral checkpoint slides (window 40 < its longer prompts): transformers without
    the window continues the 300-token prompt differently, so the parity tests above would fail
    an engine that attended the whole context."""
    from transformers import AutoModelForCausalLM

    from dabba.arch.config import ArchConfig
    from tests.conftest import hf_greedy

    ckpt = checkpoints["mistral"]
    arch = ArchConfig.from_hf(ckpt.path)
    assert arch.sliding_window == 40 and max(map(len, ckpt.prompts)) > 40
    model_info = LLM(str(ckpt.path), kv_cache_memory=2**22).llm_engine.model_info
    assert model_info.max_model_len == arch.max_position_embeddings
    full = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32, sliding_window=None).eval()
    assert full.config.sliding_window is None
    assert hf_greedy(full, ckpt.prompts[9:10], NUM_NEW_TOKENS) != ckpt.reference[9:10]


@pytest.mark.parametrize("name, change", [
    ("gemma2", dict(sliding_window=4096)),  # its layers 0 and 2 slide within 40 keys
    ("gemma2", dict(attn_logit_softcapping=None)),  # its attention scores are capped at 5
    ("gemma3", dict(sliding_window=4096)),  # layers 0, 1 and 3 slide within 40 keys
    ("gemma3", dict(rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0},
                                     "sliding_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                           "factor": 4.0}})),  # the sliding layers' own RoPE
    ("gemma3", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),  # linear
    ("gemma3", dict(query_pre_attn_scalar=32)),  # 48 ** -0.5, not head_dim ** -0.5
], ids=["gemma2-window", "gemma2-attn-softcap", "gemma3-window", "gemma3-local-rope", "gemma3-rope-scaling",
        "gemma3-scale"])
def test_each_gemma_feature_changes_the_reference(checkpoints, name, change) -> None:
    """transformers without each of the Gemma checkpoints' features (a window, the attention soft
    cap, the sliding layers' RoPE base, the global layers' RoPE scaling, query_pre_attn_scalar)
    continues the 300-token prompt differently, so the parity tests above would fail an engine
    that lacked it. (The final-logit cap is monotonic, so greedy tokens cannot see it: test_gemma
    checks it on logprobs.)"""
    from transformers import AutoModelForCausalLM

    from tests.conftest import hf_greedy

    ckpt = checkpoints[name]
    model = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32, **change).eval()
    assert all(getattr(model.config, k) == v for k, v in change.items())
    assert hf_greedy(model, ckpt.prompts[9:10], NUM_NEW_TOKENS) != ckpt.reference[9:10]
