"""The one resolved configuration (models/resolved_config.py): settled once from the checkpoint and
the machine, and read as is by the engine, every rank, the planner and the draft model."""
from __future__ import annotations

import pickle

import pytest
import torch

from dabba import LLM
from dabba.config import EngineConfig
from dabba.models.resolved_config import resolve_config
from dabba.tools.plan import plan


def test_a_checkpoint_resolves_once_and_pickles_whole(checkpoints) -> None:
    path = str(checkpoints["llama"].path)
    resolved = resolve_config(EngineConfig.from_kwargs(model=path, max_model_len=128, quantization="int8"))
    assert resolved.model_dir == resolved.tokenizer_dir == path
    assert resolved.arch.architecture == "LlamaForCausalLM" and resolved.max_model_len == 128
    assert resolved.dtype == torch.float32 and resolved.device == torch.device("cpu")  # the checkpoint's; this CPU
    assert resolved.quant_config.method == "int8" and resolved.draft is None
    assert pickle.loads(pickle.dumps(resolved)) == resolved  # what a worker process or a Ray actor receives


def test_what_cannot_resolve_is_refused_naming_the_field(checkpoints) -> None:
    path = str(checkpoints["llama"].path)
    limit = resolve_config(EngineConfig.from_kwargs(model=path)).max_model_len
    with pytest.raises(ValueError, match=f"max_model_len={limit + 1} exceeds the model's limit of {limit} tokens"):
        resolve_config(EngineConfig.from_kwargs(model=path, max_model_len=limit + 1))
    with pytest.raises(ValueError, match=f"max_model_len={limit + 1} exceeds"):  # the planner resolves it alike
        plan(path, max_model_len=limit + 1)


def test_the_draft_model_resolves_with_the_target(checkpoints) -> None:
    target, draft = str(checkpoints["llama"].path), str(checkpoints["qwen3"].path)
    resolved = resolve_config(EngineConfig.from_kwargs(
        model=target, quantization="int4", speculative_config={"model": draft, "num_speculative_tokens": 2}))
    assert resolved.draft.model_dir == draft and resolved.draft.arch.architecture == "Qwen3ForCausalLM"
    assert resolved.draft.quant_config.method == "int4"  # the load-time rounding the target asked for


def test_the_engine_and_its_rank_read_the_same_object(checkpoints) -> None:
    engine = LLM(str(checkpoints["llama"].path), kv_cache_memory=2**22, max_model_len=96).llm_engine
    runner = engine.engine_core.model_runner
    assert runner.resolved is engine.resolved
    assert (runner.max_model_len, engine.model_info.max_model_len, engine.engine_core.scheduler.max_model_len) == (96,) * 3
