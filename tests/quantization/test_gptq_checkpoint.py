"""A GPTQ checkpoint (AutoGPTQ layout, written here from the format's description) loads in dabba
and computes what its dequantized weights compute."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dabba import LLM, SamplingParams
from dabba.ops.native import load_cpu_ops
from dabba.quantization.formats import gptq_pack
from dabba.quantization.gptq import gptq_quantize
from tests.conftest import token_prompts

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_pair(src, packed_dir, dequant_dir, quantize_linear, quantization_config: dict) -> None:
    """Every linear weight of ``src`` twice: packed (``quantize_linear(name, w)`` -> (its tensors
    under the checkpoint format's names, the weight they dequantize to)) with
    ``quantization_config`` in config.json, and dequantized into a plain checkpoint."""
    shutil.copytree(src, packed_dir)
    shutil.copytree(src, dequant_dir)
    state = load_file(src / "model.safetensors")
    packed, dequant = {}, dict(state)
    for name, w in state.items():
        if not any(f".{linear}." in name for linear in LINEARS):
            packed[name] = w
            continue
        tensors, dequant[name] = quantize_linear(name, w)
        prefix = name.removesuffix(".weight")
        packed.update({f"{prefix}.{key}": t for key, t in tensors.items()})
    save_file(packed, packed_dir / "model.safetensors")
    save_file(dequant, dequant_dir / "model.safetensors")
    cfg = json.loads((packed_dir / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (packed_dir / "config.json").write_text(json.dumps(cfg))


def write_gptq_pair(src, gptq_dir, dequant_dir, group_size: int, act_order: bool) -> None:
    """The same 4-bit symmetric weights twice: GPTQ-packed, and dequantized into a plain checkpoint."""
    def quantize_linear(name: str, w: torch.Tensor):
        # q/k/v (and gate/up) see the same inputs, hence the same Hessian and act-order g_idx
        layer = int(name.split(".")[2])
        g = torch.Generator().manual_seed(layer * 10_000 + w.shape[1])
        x = torch.randn(512, w.shape[1], generator=g) * torch.exp(torch.randn(w.shape[1], generator=g))
        q = gptq_quantize(w, 2 * x.double().T @ x.double() / 512, 4, group_size, symmetric=True, act_order=act_order)
        codes, zeros = q.q + 8, q.zero + 8  # GPTQ stores unsigned codes: symmetric zero point 8
        scales = q.scale.half().float()  # the format keeps fp16 scales
        return (gptq_pack(codes, zeros, q.scale, q.g_idx, 4),
                (codes - zeros[:, q.g_idx.long()]).float() * scales[:, q.g_idx.long()])

    write_pair(src, gptq_dir, dequant_dir, quantize_linear,
               {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": True,
                "checkpoint_format": "gptq"})


def assert_same_prompt_logprobs(quantized: LLM, reference: LLM, prompts: list[list[int]]) -> None:
    """Every prompt token's logprob agrees within 1e-3 between the two engines."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = zip(quantized.generate(token_prompts(prompts), params, use_tqdm=False),
               reference.generate(token_prompts(prompts), params, use_tqdm=False), prompts)
    for a, b, p in outs:
        got = torch.tensor([a.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))])
        want = torch.tensor([b.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))])
        assert torch.allclose(got, want, atol=1e-3), (got - want).abs().max()


def write_awq_pair(src, awq_dir, dequant_dir, group_size: int) -> None:
    """AutoAWQ's "gemm" layout (asymmetric 4-bit codes with zero points), and the same weights
    dequantized into a plain checkpoint."""
    from dabba.quantization.formats import awq_pack
    from dabba.quantization.rtn import quantize

    def quantize_linear(name: str, w: torch.Tensor):
        q = quantize(w, 4, group_size, symmetric=False)
        scales = q.scale.half().float()
        return (awq_pack(q.q, q.zero, q.scale),
                (q.q.view(w.shape[0], -1, group_size) - q.zero[..., None]).float().mul(scales[..., None]).view_as(w))

    write_pair(src, awq_dir, dequant_dir, quantize_linear,
               {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm", "zero_point": True})


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_checkpoint_matches_its_dequantized_weights(checkpoints, tmp_path, act_order) -> None:
    ckpt = checkpoints["llama"]
    write_gptq_pair(ckpt.path, tmp_path / "gptq", tmp_path / "dequant", 32, act_order)
    gptq = LLM(str(tmp_path / "gptq"), dtype="float32")
    plain = LLM(str(tmp_path / "dequant"), dtype="float32")
    runner = gptq.llm_engine.engine_core.model_runner
    layer = runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.quant_method.packed == (not act_order)  # int4 kernel unless act-order forces the fallback
    if load_cpu_ops():  # act-order layers (dequantized) have no form in the native layer loop
        assert (runner.native_loop is None) == act_order
        if act_order:
            assert runner.layer_loop_reason == "model.layers.0.self_attn.qkv_proj (GPTQLinearMethod) has no native form"
    assert_same_prompt_logprobs(gptq, plain, ckpt.prompts[3:8])
    prompts = token_prompts(ckpt.prompts[3:8])
    out = gptq.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)


def test_merged_shards_must_agree_on_g_idx(checkpoints, tmp_path) -> None:
    write_gptq_pair(checkpoints["llama"].path, tmp_path / "gptq", tmp_path / "dequant", 32, True)
    state = load_file(tmp_path / "gptq" / "model.safetensors")
    state["model.layers.0.self_attn.k_proj.g_idx"] = state["model.layers.0.self_attn.k_proj.g_idx"].flip(0)
    save_file(state, tmp_path / "gptq" / "model.safetensors")
    with pytest.raises(ValueError, match="disagree"):
        LLM(str(tmp_path / "gptq"))


def test_a_quantized_checkpoint_refuses_load_time_quantization(checkpoints, tmp_path) -> None:
    write_gptq_pair(checkpoints["llama"].path, tmp_path / "gptq", tmp_path / "dequant", 32, False)
    with pytest.raises(ValueError, match="already quantized"):
        LLM(str(tmp_path / "gptq"), quantization="int8")


def test_awq_checkpoint_matches_its_dequantized_weights(checkpoints, tmp_path) -> None:
    ckpt = checkpoints["llama"]
    write_awq_pair(ckpt.path, tmp_path / "awq", tmp_path / "dequant", 32)
    awq, plain = LLM(str(tmp_path / "awq"), dtype="float32"), LLM(str(tmp_path / "dequant"), dtype="float32")
    assert_same_prompt_logprobs(awq, plain, ckpt.prompts[3:8])
