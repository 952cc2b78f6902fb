"""W8A8 at load time (quantization="w8a8") on whole models: quality against bf16, the kernels
against the PyTorch reference through the engine, and the planner's bytes."""
from __future__ import annotations

import pytest
import torch

from dabba import LLM, SamplingParams
from dabba.config import DEMO_MODEL
from dabba.models.sizes import weights_bytes
from dabba.ops import native
from dabba.quantization import w8a8
from dabba.quantization.config import QuantConfig
from dabba.tools.evaluation import kl_divergence

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_demo_model_w8a8_is_within_the_issue_bar_of_bf16() -> None:
    """Mean KL(bf16 || W8A8) on held-out text at most 0.01 nats a token (issue 42's bar)."""
    text = open(f"{DEMO_MODEL}/heldout.txt").read()[:12_000]
    result = kl_divergence(DEMO_MODEL, DEMO_MODEL, text, "w8a8", max_length=128, max_windows=16)
    assert result.num_tokens > 1500
    assert result.kl_divergence < 0.01 and result.top1_agreement > 0.9


@pytest.mark.skipif(not native.load_cpu_ops(), reason="native kernels unavailable")
def test_the_kernels_give_the_reference_tokens_through_the_engine(checkpoints, monkeypatch) -> None:
    """Batched prefill (the GEMM's rows) and decode: the same greedy tokens as the PyTorch
    reference, which the kernels equal bit for bit."""
    ckpt = checkpoints["llama"]
    prompts = [{"prompt_token_ids": p} for p in ckpt.prompts[:6]]
    ours = LLM(str(ckpt.path), dtype="float32", quantization="w8a8").generate(prompts, GREEDY, use_tqdm=False)
    monkeypatch.setattr(w8a8.native, "load_cpu_ops", lambda: False)  # the layers take w8a8_reference
    llm = LLM(str(ckpt.path), dtype="float32", quantization="w8a8", native_layer_loop="off")
    reference = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in reference]


def test_the_planner_counts_the_packed_codes() -> None:
    llm = LLM(DEMO_MODEL, quantization="w8a8")
    runner = llm.llm_engine.engine_core.model_runner
    planned = weights_bytes(llm.llm_engine.resolved.arch, torch.bfloat16, QuantConfig("w8a8"), "cpu")
    assert planned == runner.weight_bytes
    out = llm.generate("The json module", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8
