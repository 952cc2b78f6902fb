"""AWQ: the scale search, the clip search, the fold into the previous op, and `dabba quantize --method awq`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dabba import LLM, SamplingParams
from dabba.arch.config import ArchConfig
from dabba.attention.backend import forward_context
from dabba.attention.dense import DenseCausalBackend
from dabba.config import DEMO_MODEL
from dabba.entrypoints.cli import main
from dabba.layers.linear import Linear
from dabba.models.loader import load_model
from dabba.quantization.awq import awq_clip_layer, awq_scale_layer, fake_quantize, search_clip, search_scale
from dabba.tools.evaluation import kl_divergence


def activations(tokens: int, in_features: int, outliers: int, seed: int = 0) -> torch.Tensor:
    """Hidden states with a few channels far larger than the rest, as real LLMs have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=g)
    x[:, torch.randperm(in_features, generator=torch.Generator().manual_seed(7))[:outliers]] *= 30
    return x


def output_error(w: torch.Tensor, wq: torch.Tensor, x: torch.Tensor) -> float:
    return float(((x @ w.T - x @ wq.T) ** 2).mean())


def awq_weight(w: torch.Tensor, x: torch.Tensor, group_size: int) -> torch.Tensor:
    weight = w.clone()
    s = search_scale(x.abs().mean(0), [weight], lambda: x @ weight.T, 4, group_size)
    assert torch.equal(weight, w)  # the search restores the live weights
    return fake_quantize(w * s, 4, group_size) / s


def test_scales_protect_outlier_channels() -> None:
    torch.manual_seed(0)
    w = torch.randn(128, 256) * 0.05
    x, unseen = activations(1024, 256, outliers=4), activations(1024, 256, outliers=4, seed=1)
    e_awq = output_error(w, awq_weight(w, x, 64), unseen)
    e_rtn = output_error(w, fake_quantize(w, 4, 64), unseen)
    assert e_awq < 0.5 * e_rtn, f"AWQ {e_awq:.3e} vs RTN {e_rtn:.3e}"


def test_scale_search_never_loses_to_plain_rounding() -> None:
    """Identity is among the candidates, so on the calibration data AWQ's error is at most RTN's."""
    torch.manual_seed(0)
    w = torch.randn(64, 128) * 0.05
    x = activations(512, 128, outliers=0)
    assert output_error(w, awq_weight(w, x, 32), x) <= output_error(w, fake_quantize(w, 4, 32), x)


def test_clip_search_lowers_each_groups_error() -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.05
    w[torch.rand_like(w) < 0.01] *= 8  # a few large weights stretch their group's range
    x = activations(512, 128, outliers=2)
    bound = search_clip(w, x, 4, 32)
    max_abs = w.abs().view(96, 4, 32).amax(-1)
    assert (bound <= max_abs).all() and (bound >= 0.5 * max_abs - 1e-6).all() and (bound < max_abs).any()
    clipped = torch.maximum(torch.minimum(w.view(96, 4, 32), bound[..., None]), -bound[..., None]).view(96, 128)
    per_group = lambda wq: ((x.view(-1, 4, 32) * (w - wq).view(96, 1, 4, 32)).sum(-1) ** 2).mean(1)  # [out, G]
    assert (per_group(fake_quantize(clipped, 4, 32)) <= per_group(fake_quantize(w, 4, 32)) + 1e-12).all()


@pytest.mark.parametrize("name", ["qwen2", "llama"])  # qwen2: MHA (o_proj scaled through v) with q/k/v biases
def test_folded_scales_keep_the_full_precision_layer(checkpoints, name) -> None:
    ckpt = checkpoints[name]
    arch = ArchConfig.from_hf(ckpt.path)
    model = load_model(ckpt.path, arch, torch.float32, torch.device("cpu"), max_position=64)
    layer, seq_len = model.model.layers[0], 32
    torch.manual_seed(0)
    x = torch.randn(4 * seq_len, arch.hidden_size)
    rope = model.model.rotary.cos_sin(torch.arange(seq_len).repeat(4), torch.float32)
    with forward_context(DenseCausalBackend(seq_len), [None], [None] * arch.num_hidden_layers):
        inputs: dict[str, list[torch.Tensor]] = {}
        hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: inputs.setdefault(n, []).append(args[0].clone()))
                 for n, m in layer.named_modules() if isinstance(m, Linear)]
        before, _ = layer(rope, x.clone(), None)
        for h in hooks:
            h.remove()
        weights = {n: p.clone() for n, p in layer.named_parameters()}
        captured = {n: torch.cat(v) for n, v in inputs.items()}
        awq_scale_layer(layer, captured, rope, 4, 32, search_tokens=2 * seq_len)
        after, _ = layer(rope, x.clone(), None)
        changed = {n for n, p in layer.named_parameters() if not torch.equal(p, weights[n])}
        assert {"input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_up_proj.weight",
                "mlp.down_proj.weight"} <= changed
        assert ("self_attn.o_proj.weight" in changed) == (arch.num_attention_heads == arch.num_key_value_heads)
        torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)
        # the captured inputs now are what the scaled linears see
        probe = {}
        hook = layer.mlp.down_proj.register_forward_pre_hook(lambda mod, args: probe.setdefault("x", args[0]))
        layer(rope, x.clone(), None)
        hook.remove()
        torch.testing.assert_close(probe["x"], captured["mlp.down_proj"], rtol=1e-4, atol=1e-5)
        # clipping changes the weights, but never q's and k's rows
        scaled = {n: p.clone() for n, p in layer.named_parameters()}
        awq_clip_layer(layer, captured, 4, 32)
        qk_rows = slice(0, layer.self_attn.q_size + layer.self_attn.kv_size)
        qkv = layer.self_attn.qkv_proj.weight
        assert torch.equal(qkv[qk_rows], scaled["self_attn.qkv_proj.weight"][qk_rows])
        assert (qkv.abs() <= scaled["self_attn.qkv_proj.weight"].abs()).all()
        assert not torch.equal(layer.mlp.down_proj.weight, scaled["mlp.down_proj.weight"])


def test_quantize_awq_tiny_checkpoint(checkpoints, tmp_path, capsys) -> None:
    ckpt = checkpoints["qwen2"]
    calib = tmp_path / "calib.txt"
    calib.write_text(open(f"{DEMO_MODEL}/calibration.txt").read()[:30_000])
    assert main(["quantize", str(ckpt.path), str(tmp_path / "q"), "--method", "awq", "--group-size", "32",
                 "--calibration", str(calib), "--num-samples", "8", "--seq-len", "64"]) == 0
    config = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["quantization_config"]
    assert config == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
                      "modules_to_not_convert": None}
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    assert tensors["model.layers.0.self_attn.q_proj.qweight"].shape == (96, 96 // 8)
    assert tensors["model.layers.0.self_attn.q_proj.bias"].dtype == torch.float16
    source = load_file(ckpt.path / "model.safetensors")
    norm = "model.layers.0.input_layernorm.weight"
    assert tensors[norm].dtype == source[norm].dtype and not torch.equal(tensors[norm], source[norm])
    llm = LLM(str(tmp_path / "q"), dtype="float32")
    out = llm.generate({"prompt_token_ids": ckpt.prompts[4]},
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def test_awq_refuses_what_its_format_cannot_hold(tmp_path, capsys) -> None:
    assert main(["quantize", DEMO_MODEL, str(tmp_path / "q"), "--method", "awq", "--bits", "8"]) != 0
    assert "bits: AWQ's gemm format holds 4-bit codes only" in capsys.readouterr().err
    assert main(["quantize", DEMO_MODEL, str(tmp_path / "q"), "--method", "awq", "--group-size", "256"]) != 0
    assert "group_size: AWQ needs every layer width" in capsys.readouterr().err


def test_awq_and_gptq_are_closer_to_the_demo_model_than_rtn(demo_quantized) -> None:
    """KL divergence from the bf16 model on its held-out text: the papers' ordering at INT4 g128."""
    text = Path(DEMO_MODEL, "heldout.txt").read_text()
    rtn = kl_divergence(DEMO_MODEL, DEMO_MODEL, text, quantization="int4", max_windows=32)
    awq = kl_divergence(str(demo_quantized["awq"]), DEMO_MODEL, text, max_windows=32)
    gptq = kl_divergence(str(demo_quantized["gptq"]), DEMO_MODEL, text, max_windows=32)
    int8 = kl_divergence(DEMO_MODEL, DEMO_MODEL, text, quantization="int8", max_windows=32)
    assert int8.kl_divergence < 0.1 * awq.kl_divergence
    assert gptq.kl_divergence < awq.kl_divergence < 0.95 * rtn.kl_divergence, (gptq, awq, rtn)
    assert awq.top1_agreement > rtn.top1_agreement
