"""Mixture-of-experts (dabba/layers/moe.py, dabba/models/moe.py): routing as transformers routes it,
ties included; only the chosen experts read; experts per tensor or stacked in the checkpoint; what
is not supported yet refused. Greedy parity with transformers for each family, under chunked
prefill, prefix caching and preemption, is tests/test_parity.py's (conftest's mixtral, qwen3moe,
olmoe checkpoints)."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dabba import LLM, SamplingParams
from dabba.arch.config import ArchConfig, MoEConfig
from dabba.layers.fused_moe import Expert, moe_forward, route
from tests.conftest import NUM_NEW_TOKENS, hf_greedy, token_prompts


def moe_config(num_experts: int, top_k: int, renormalize: bool, in_model_dtype: bool) -> MoEConfig:
    return MoEConfig(num_experts, top_k, 8, renormalize, in_model_dtype, (True,))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe-renormalised", "qwen3_moe", "olmoe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_matches_transformers_ties_included(family, dtype) -> None:
    """Experts 1, 3 and 5 have the same router row, so their scores tie exactly: the top-k must
    pick among them as transformers' router does (both use torch.topk on the same float32
    probabilities), with the same weights, renormalised and rounded as each family does."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    weight = torch.randn(6, 16)
    weight[3] = weight[5] = weight[1]
    if family == "mixtral":
        router = MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=6, num_experts_per_tok=2))
        cfg = moe_config(6, 2, True, False)
    elif family == "olmoe":
        router = OlmoeTopKRouter(OlmoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=3))
        cfg = moe_config(6, 3, False, True)
    else:
        renormalise = family.endswith("renormalised")
        router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=3,
                                                   norm_topk_prob=renormalise))
        cfg = moe_config(6, 3, renormalise, True)
    router = router.to(dtype)
    router.weight.data = weight.to(dtype)
    x = torch.randn(200, 16).to(dtype)
    x[:50] = 0  # every score equal: a 6-way tie
    _, want_weights, want_experts = router(x)
    weights, experts = route(F.linear(x, weight.to(dtype)), cfg)
    assert torch.equal(experts, want_experts)
    assert weights.dtype == want_weights.dtype and torch.equal(weights, want_weights)
    assert torch.isin(experts[50:, :2], torch.tensor([1, 3, 5])).all(dim=1).any()  # tied experts top a row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_match_transformers_and_unchosen_ones_are_never_read(dtype) -> None:
    """Tokens routed to experts 0, 2 and 4 only: experts 1, 3 and 5 hold NaNs, which any call of
    them would spread; the output equals transformers' experts module on the same weights (float32
    to rounding; bf16 through dabba's kernels within bf16's)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(1)
    reference = MixtralExperts(MixtralConfig(hidden_size=64, intermediate_size=40, num_local_experts=6))
    reference.gate_up_proj.data.normal_(0, 0.2)
    reference.down_proj.data.normal_(0, 0.2)
    x = torch.randn(37, 64)
    chosen = torch.tensor([0, 2, 4])[torch.randint(0, 3, (37, 2))]
    chosen[:, 1] = (chosen[:, 0] + 2) % 6  # two different experts a token
    weights = torch.softmax(torch.randn(37, 2), dim=-1)
    want = reference(x, chosen, weights)
    experts = nn.ModuleList(Expert(64, 40, "silu", f"experts.{e}", None) for e in range(6)).to(dtype)
    with torch.no_grad():
        for e, expert in enumerate(experts):
            unchosen = e % 2 == 1
            expert.gate_up_proj.weight.copy_(reference.gate_up_proj[e] * (float("nan") if unchosen else 1))
            expert.down_proj.weight.copy_(reference.down_proj[e] * (float("nan") if unchosen else 1))
    got = moe_forward(x.to(dtype), weights, chosen, experts)
    assert got.dtype == dtype and torch.isfinite(got).all()
    tolerance = 1e-5 if dtype == torch.float32 else 0.03
    assert (got.float() - want).abs().max() <= tolerance * want.abs().max()


def test_stacked_expert_tensors_load_as_per_expert_ones(checkpoints, tmp_path) -> None:
    """transformers 5 can hold a layer's experts as two stacked tensors (experts.gate_up_proj
    [experts, 2 * intermediate, hidden], experts.down_proj [experts, hidden, intermediate]): a
    checkpoint written that way gives the same tokens as the per-expert one."""
    from safetensors.torch import load_file, save_file

    ckpt = checkpoints["mixtral"]
    stacked_dir = tmp_path / "stacked"
    shutil.copytree(ckpt.path, stacked_dir)
    tensors = load_file(str(ckpt.path / "model.safetensors"))
    out, experts = {}, {}
    for name, tensor in tensors.items():
        if ".experts." in name:
            layer, rest = name.split(".block_sparse_moe.experts.")
            e, proj, _ = rest.split(".")
            experts.setdefault(layer, {}).setdefault(int(e), {})[proj] = tensor
        else:
            out[name] = tensor
    for layer, per_expert in experts.items():
        order = sorted(per_expert)
        out[f"{layer}.block_sparse_moe.experts.gate_up_proj"] = torch.stack(
            [torch.cat([per_expert[e]["w1"], per_expert[e]["w3"]]) for e in order])
        out[f"{layer}.block_sparse_moe.experts.down_proj"] = torch.stack([per_expert[e]["w2"] for e in order])
    save_file(out, str(stacked_dir / "model.safetensors"), metadata={"format": "pt"})
    greedy = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0, ignore_eos=True)
    outputs = LLM(str(stacked_dir), dtype="float32").generate(token_prompts(ckpt.prompts[5:8]), greedy)
    assert [o.outputs[0].token_ids for o in outputs] == ckpt.reference[5:8]


def test_routing_changes_the_reference(checkpoints) -> None:
    """Without renormalising its top-3 weights, transformers continues the Qwen3-MoE checkpoint's
    300-token prompt differently: the parity tests would catch an engine that routed otherwise."""
    from transformers import AutoModelForCausalLM

    ckpt = checkpoints["qwen3moe"]
    other = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32, norm_topk_prob=False).eval()
    assert hf_greedy(other, ckpt.prompts[9:10], NUM_NEW_TOKENS) != ckpt.reference[9:10]


QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=48,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=16)


def test_config_reads_routing_and_dense_layers() -> None:
    arch = ArchConfig.from_dict({**QWEN3_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": True})
    assert arch.moe == MoEConfig(num_experts=8, top_k=2, intermediate_size=16, renormalize=True,
                                 weights_in_model_dtype=True, sparse_layers=(False, True, False, False))
    mixtral = ArchConfig.from_dict({**QWEN3_MOE, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4})
    assert mixtral.moe.num_experts == 4 and mixtral.moe.intermediate_size == 48 and mixtral.moe.renormalize
    assert not mixtral.moe.weights_in_model_dtype and mixtral.moe.sparse_layers == (True,) * 4
    olmoe = ArchConfig.from_dict({**QWEN3_MOE, "architectures": ["OlmoeForCausalLM"], "clip_qkv": None})
    assert olmoe.qk_norm_whole and not olmoe.moe.renormalize


@pytest.mark.parametrize("change, message", [
    (dict(num_experts_per_tok=9), "must not exceed the number of experts"),
    (dict(num_experts=0), "positive integer num_experts"),
    (dict(architectures=["OlmoeForCausalLM"], clip_qkv=8.0), "clip_qkv"),
])
def test_bad_moe_configs_are_refused(change, message) -> None:
    with pytest.raises(ValueError, match=message):
        ArchConfig.from_dict({**QWEN3_MOE, **change})


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_load_time_quantization_quantizes_every_expert(checkpoints, method) -> None:
    """INT8/INT4 round-to-nearest at load for each expert's projections (the router stays as it
    is); the model generates, its first tokens mostly the float model's, and the planner's bytes
    are what the engine holds."""
    from dabba.models.sizes import weights_bytes
    from dabba.quantization.base import UnquantizedLinearMethod
    from dabba.quantization.config import QuantConfig
    from dabba.quantization.rtn import Int4RTNMethod, Int8RTNMethod

    ckpt = checkpoints["mixtral"]
    llm = LLM(str(ckpt.path), dtype="bfloat16", quantization=method)
    runner = llm.llm_engine.engine_core.model_runner
    for layer in runner.model.model.layers:
        assert isinstance(layer.mlp.gate.quant_method, UnquantizedLinearMethod)
        for expert in layer.mlp.experts:
            for proj in (expert.gate_up_proj, expert.down_proj):
                assert isinstance(proj.quant_method, Int8RTNMethod if method == "int8" else Int4RTNMethod)
                assert proj.weight is None and proj.qweight is not None
    outs = llm.generate(token_prompts(ckpt.prompts[:8]), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    # RTN on a tiny random model moves close logits: INT8 keeps 11 of the first 12 tokens of the
    # float32 reference here (bf16 alone 11), INT4 7 (the dense Llama checkpoint's INT4: 5); chance
    # would be 1 in 1024
    same_first = sum(o.outputs[0].token_ids[0] == ref[0] for o, ref in zip(outs, ckpt.reference))
    assert same_first >= (6 if method == "int8" else 2), f"{same_first} of 8 first tokens are the float32 model's"
    arch = llm.llm_engine.resolved.arch
    assert weights_bytes(arch, torch.bfloat16, QuantConfig(method), "cpu") == runner.weight_bytes


def test_awq_of_a_moe_model_is_refused(checkpoints, tmp_path) -> None:
    from dabba.tools.quantize import QuantizeOptions, quantize_checkpoint

    with pytest.raises(ValueError, match="AWQ knows the dense Llama block, not MixtralForCausalLM's experts"):
        quantize_checkpoint(checkpoints["mixtral"].path, tmp_path / "q", "x " * 1000,
                            QuantizeOptions(method="awq", group_size=32))
