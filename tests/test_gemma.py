"""Gemma 2 and Gemma 3 (text): config normalisation and refusals, Gemma's layers against
transformers' (norm, embedding scale, RoPE tables, the soft-capped reference attention), logprobs
(the final-logit soft cap), quantized loads (INT8/INT4 at load time, GPTQ and AWQ checkpoints)
and `dabba plan`. Greedy parity with transformers on both attention backends, chunked prefill,
prefix caching and preemption runs in tests/test_parity.py over the "gemma2" and "gemma3"
checkpoints; the native layer loop against the Python layers in tests/test_native_layer_loop.py."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dabba import LLM, SamplingParams
from dabba.arch.config import ArchConfig
from tests.conftest import run_checked, token_prompts

# google/gemma-3-1b-it's config.json as published (transformers 4.50: the older spelling, no layer_types)
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
    "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106], "final_logit_softcapping": None,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
    "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "vocab_size": 262144,
}
# google/gemma-2-2b's, likewise (no layer_types: every other layer slides, from layer 0)
GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False, "attn_logit_softcapping": 50.0,
    "bos_token_id": 2, "eos_token_id": 1, "final_logit_softcapping": 30.0, "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
    "intermediate_size": 9216, "max_position_embeddings": 8192, "num_attention_heads": 8, "num_hidden_layers": 26,
    "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32", "vocab_size": 256000,
}


def transformers_dict(config) -> dict:
    """What transformers 5 writes to config.json for ``config``."""
    return {**config.to_dict(), "architectures": [config.architectures[0]] if config.architectures else None}


# ---- config normalisation --------------------------------------------------------------------

def test_published_configs_normalise() -> None:
    g3 = ArchConfig.from_dict(GEMMA3_1B)
    assert (g3.head_dim, g3.num_key_value_heads, g3.sliding_window, g3.mlp_activation, g3.qk_norm) == \
        (256, 1, 512, "gelu_tanh", True)
    assert g3.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(26))  # layers 5, 11, 17, 23 global
    assert [g3.layer_sliding_window(i) for i in (0, 4, 5, 6, 25)] == [512, 512, None, 512, 512]
    assert (g3.rope_theta, g3.rope_local_theta, g3.rope_scaling.rope_type) == (1e6, 1e4, "default")
    assert g3.attn_scale == 256 ** -0.5 and g3.tie_word_embeddings  # tied by default
    assert g3.attn_logit_softcapping is None and g3.final_logit_softcapping is None
    g2 = ArchConfig.from_dict(GEMMA2_2B)
    assert g2.sliding_layers == tuple(i % 2 == 0 for i in range(26))
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.rope_local_theta, g2.qk_norm) == \
        (50.0, 30.0, None, False)


def test_both_rope_spellings_normalise_the_same() -> None:
    """Gemma 3 4B's text config in the older spelling (rope_theta, rope_local_base_freq, rope_scaling
    for the global layers) and as transformers 5 writes it (rope_parameters keyed by layer type)."""
    from transformers import Gemma3TextConfig

    old = {**GEMMA3_1B, "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_local_base_freq": 20000.0}
    config = Gemma3TextConfig(**{k: v for k, v in old.items() if k not in ("architectures", "model_type")})
    config.architectures = ["Gemma3ForCausalLM"]
    new = transformers_dict(config)
    assert set(new["rope_parameters"]) == {"full_attention", "sliding_attention"}
    a, b = ArchConfig.from_dict(old), ArchConfig.from_dict(new)
    assert a == b
    assert (a.rope_theta, a.rope_scaling.rope_type, a.rope_scaling.factor, a.rope_local_theta) == \
        (1e6, "linear", 8.0, 20000.0)
    # Gemma 2 writes one flat rope_parameters; its older configs rope_theta
    from transformers import Gemma2Config

    g2 = Gemma2Config(**{k: v for k, v in GEMMA2_2B.items() if k not in ("architectures", "model_type", "hidden_act")})
    g2.architectures = ["Gemma2ForCausalLM"]
    assert ArchConfig.from_dict(transformers_dict(g2)) == ArchConfig.from_dict(GEMMA2_2B)


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention", "full_attention",
                                                "sliding_attention", "full_attention"]])
def test_layer_types(layer_types) -> None:
    """An explicit layer_types wins over sliding_window_pattern; without one, the pattern decides."""
    cfg = {**GEMMA3_1B, "num_hidden_layers": 5, "sliding_window_pattern": 2, "layer_types": layer_types}
    arch = ArchConfig.from_dict(cfg)
    expected = layer_types or ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    assert arch.sliding_layers == tuple(t == "sliding_attention" for t in expected)
    from transformers import Gemma3TextConfig

    theirs = Gemma3TextConfig(num_hidden_layers=5, sliding_window_pattern=2, layer_types=layer_types)
    assert theirs.layer_types == expected


def test_rope_tables_equal_transformers() -> None:
    """Both kinds of layer's cos/sin, bit for bit: the global layers' linear-scaled base 10^6, the
    sliding layers' 10^4."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from dabba.layers.rotary import LayerTypeRotary

    config = Gemma3TextConfig(head_dim=32, num_hidden_layers=4, sliding_window_pattern=3,
                              rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    config.architectures = ["Gemma3ForCausalLM"]
    arch = ArchConfig.from_dict(transformers_dict(config))
    theirs = Gemma3RotaryEmbedding(config)
    ours = LayerTypeRotary(arch.head_dim, 300, arch.rope_theta, arch.rope_scaling, arch.rope_local_theta)
    positions = torch.arange(300)
    tables = ours.cos_sin(positions, torch.float32)
    for kind in ("full_attention", "sliding_attention"):
        cos, sin = theirs(torch.zeros(1), positions[None], kind)
        assert torch.equal(tables[kind][0], cos[0]) and torch.equal(tables[kind][1], sin[0]), kind
    assert not torch.equal(tables["full_attention"][0], tables["sliding_attention"][0])


def test_gemma3_attention_ignores_attn_logit_softcapping() -> None:
    """transformers' Gemma3Attention never passes attn_logit_softcapping to its attention (only
    Gemma 2's does), so dabba drops it for Gemma 3; the final-logit cap applies to both."""
    cfg = ArchConfig.from_dict({**GEMMA3_1B, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0})
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping == 3.0
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, initializer_range=0.5)
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    logits = []
    for cap in (None, 0.5):
        torch.manual_seed(0)
        model = Gemma3ForCausalLM(Gemma3TextConfig(**small, attn_logit_softcapping=cap)).eval()
        with torch.inference_mode():
            logits.append(model(ids).logits)
    assert torch.equal(logits[0], logits[1])


# ---- refusals --------------------------------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    ({"hidden_activation": "gelu"}, r"unsupported hidden_activation 'gelu'"),
    ({"hidden_activation": "relu"}, r"unsupported hidden_activation 'relu'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}}, r"unsupported rope_scaling type 'dynamic' for Gemma3"),
    ({"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}},
     r"unsupported rope_scaling type 'dynamic'"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     r"sliding_attention layers.*only the default rope"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, r"must be keyed by layer type"),
    ({"layer_types": ["sliding_attention"] * 3}, r"layer_types must list one of .* per layer \(26\)"),
    ({"layer_types": ["local"] * 26}, r"layer_types must list one of"),
    ({"use_bidirectional_attention": True}, r"use_bidirectional_attention"),
    ({"query_pre_attn_scalar": 0}, r"query_pre_attn_scalar must be a number > 0"),
    ({"final_logit_softcapping": -1.0}, r"final_logit_softcapping must be a number > 0 or null"),
    ({"sliding_window": 0}, r"sliding_window must be >= 1 or null"),
])
def test_unsupported_configs_are_refused(change, message) -> None:
    with pytest.raises(ValueError, match=message):
        ArchConfig.from_dict({**GEMMA3_1B, **change})


def test_gemma2_refuses_per_layer_type_rope_it_cannot_apply() -> None:
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e5}}
    with pytest.raises(ValueError, match="rope_parameters differ by layer type for Gemma2ForCausalLM"):
        ArchConfig.from_dict({**GEMMA2_2B, "rope_parameters": rope})
    same = {kind: {"rope_type": "default", "rope_theta": 1e5} for kind in rope}
    assert ArchConfig.from_dict({**GEMMA2_2B, "rope_parameters": same}).rope_theta == 1e5


# ---- layers against transformers' ------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_embedding_scale_equal_transformers(dtype) -> None:
    """GemmaRMSNorm is (x * rsqrt(mean x^2 + eps)) * (1 + w) in float32, rounded once; the embedding
    scale sqrt(1152) = 33.94 is rounded to 34.0 in bf16 first: both bit for bit."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm, Gemma3TextScaledWordEmbedding

    from dabba.layers.embedding import VocabEmbedding
    from dabba.layers.layernorm import GemmaRMSNorm, RMSNorm

    torch.manual_seed(0)
    x, residual, w = torch.randn(7, 3, 1152, dtype=dtype) * 3, torch.randn(7, 3, 1152, dtype=dtype), torch.randn(1152)
    theirs, ours = Gemma3RMSNorm(1152, 1e-6).to(dtype), GemmaRMSNorm(1152, 1e-6).to(dtype)
    theirs.weight.data.copy_(w)
    ours.weight.data.copy_(w)
    assert torch.equal(ours._norm(x), theirs(x))  # the reference path, op for op

    def one_rounding_apart(got: torch.Tensor, want: torch.Tensor) -> bool:
        # the native kernels sum the squares in another order (and take 1/sqrt, not rsqrt): float32
        # rounding apart before the output's own rounding, so a bf16 output is at most an ulp off
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
        return bool(((got.double() - want.double()).abs() <= ulp * want.double().abs() + 1e-6).all())

    assert one_rounding_apart(ours(x), theirs(x))
    x_own, residual_own = x.clone(), residual.clone()  # the fused form updates both in place
    normed, summed = ours(x_own, residual_own)
    assert torch.equal(summed, residual + x) and one_rounding_apart(normed, theirs(residual + x))
    q = torch.randn(5, 6 * 256, dtype=dtype).view(5, 6, 256)[:, :4]  # q of a merged q/k/v projection
    head_norm = GemmaRMSNorm(256, 1e-6).to(dtype)
    head_norm.weight.data.copy_(w[:256])
    assert one_rounding_apart(head_norm(q), head_norm._norm(q))
    llama = RMSNorm(1152, 1e-6).to(dtype)
    llama.weight.data.copy_(1 + w.to(dtype))
    if dtype == torch.bfloat16:  # Llama's rounds before it scales: not the same numbers
        assert not torch.equal(llama(x.reshape(-1, 1152).contiguous()), theirs(x).reshape(-1, 1152))

    emb_theirs = Gemma3TextScaledWordEmbedding(50, 1152, 0, embed_scale=1152 ** 0.5).to(dtype)
    emb_ours = VocabEmbedding(50, 1152, scale=1152 ** 0.5).to(dtype)
    emb_ours.weight.data.copy_(emb_theirs.weight.data)
    ids = torch.arange(50)
    assert torch.equal(emb_ours(ids), emb_theirs(ids))
    if dtype == torch.bfloat16:
        assert not torch.equal(emb_ours(ids), (emb_ours.weight * 1152 ** 0.5).to(dtype))


def test_softcapped_reference_attention_equals_transformers_eager() -> None:
    """torch_ref's softcapped_attention (also the dense backend's) against transformers' Gemma 2
    eager attention, with GQA, head_dim 256 and a sliding-window mask."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    from dabba.attention.dense import DenseCausalBackend
    from dabba.attention.torch_ref import softcapped_attention, window_mask

    torch.manual_seed(0)
    heads, kv_heads, L, d, scale, cap = 4, 2, 50, 256, 0.3, 5.0
    q, k, v = torch.randn(1, heads, L, d), torch.randn(1, kv_heads, L, d), torch.randn(1, kv_heads, L, d)
    allowed = window_mask(0, L, 20, q.device)
    mask = torch.zeros(L, L).masked_fill(~allowed, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False, head_dim=d)
    theirs, _ = eager_attention_forward(module, q, k, v, mask[None, None], scaling=scale, softcap=cap)
    ours = softcapped_attention(q[0], k[0], v[0], allowed, scale, cap)
    torch.testing.assert_close(ours.transpose(0, 1), theirs[0], atol=1e-6, rtol=1e-5)
    dense = DenseCausalBackend(L).forward(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), None,
                                          None, scale, 20, cap)
    torch.testing.assert_close(dense, theirs[0], atol=1e-6, rtol=1e-5)
    uncapped, _ = eager_attention_forward(module, q, k, v, mask[None, None], scaling=scale, softcap=None)
    assert (uncapped - theirs).abs().max() > 0.1


# ---- the engine on the tiny checkpoints -------------------------------------------------------

def hf_logits(path, token_ids: list[int], **overrides) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **overrides).eval()
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0]  # [len, vocab]


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_prompt_logprobs_match_transformers(checkpoints, name) -> None:
    """Logprobs see what greedy tokens cannot: Gemma 2's final-logit cap (3.0; tanh is monotonic,
    so it never changes an argmax) — transformers without it gives other logprobs."""
    ckpt = checkpoints[name]
    prompt = ckpt.prompts[7]  # 100 tokens: past the 40-key window
    llm = LLM(str(ckpt.path), dtype="float32", kv_cache_memory=2**22, max_num_batched_tokens=48)  # chunked
    out = run_checked(llm, token_prompts([prompt]), SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    ours = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
    ref = hf_logits(ckpt.path, prompt).log_softmax(-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    if name == "gemma2":
        uncapped = hf_logits(ckpt.path, prompt, final_logit_softcapping=None).log_softmax(-1)
        assert (uncapped[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])] - ref).abs().max() > 0.1


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_load_time_quantization_generates(checkpoints, name, quantization) -> None:
    """INT8/INT4 round-to-nearest at load time: every linear quantized (the GeGLU gate_up too), and
    the prompt logprobs near the full-precision model's."""
    ckpt = checkpoints[name]
    prompts = token_prompts(ckpt.prompts[4:7])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    llm = LLM(str(ckpt.path), dtype="float32", quantization=quantization, kv_cache_memory=2**22)
    layer = llm.llm_engine.engine_core.model_runner.model.model.layers[0]
    method = {"int8": "Int8RTNMethod", "int4": "Int4RTNMethod"}[quantization]
    assert {type(m.quant_method).__name__ for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj)} == {method}
    outs = run_checked(llm, prompts, params)
    full = run_checked(LLM(str(ckpt.path), dtype="float32", kv_cache_memory=2**22), prompts, params)
    for quant, ref, prompt in zip(outs, full, prompts):
        assert len(quant.outputs[0].token_ids) == 8
        ids = prompt["prompt_token_ids"]
        got = torch.tensor([quant.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
        want = torch.tensor([ref.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
        error = (got - want).abs().mean().item()
        assert 0 < error < {"int8": 0.05, "int4": 0.5}[quantization], error


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gptq_and_awq_checkpoints_load_and_generate(checkpoints, tmp_path, name, fmt) -> None:
    """A GPTQ (symmetric, act-order) and an AWQ checkpoint of the family load and compute what their
    dequantized weights compute; Gemma's norms, q/k norms and LM head stay full precision."""
    from tests.quantization.test_gptq_checkpoint import assert_same_prompt_logprobs, write_awq_pair, write_gptq_pair

    ckpt = checkpoints[name]
    if fmt == "gptq":
        write_gptq_pair(ckpt.path, tmp_path / "q", tmp_path / "dequant", 32, act_order=True)
    else:
        write_awq_pair(ckpt.path, tmp_path / "q", tmp_path / "dequant", 32)
    quantized = LLM(str(tmp_path / "q"), dtype="float32", kv_cache_memory=2**22)
    plain = LLM(str(tmp_path / "dequant"), dtype="float32", kv_cache_memory=2**22)
    layers = quantized.llm_engine.engine_core.model_runner.model.model.layers
    method = type(layers[0].mlp.gate_up_proj.quant_method).__name__
    assert method == {"gptq": "GPTQLinearMethod", "awq": "AWQLinearMethod"}[fmt]
    assert_same_prompt_logprobs(quantized, plain, ckpt.prompts[5:8])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = token_prompts(ckpt.prompts[5:7])
    outs = [o.outputs[0].token_ids for o in quantized.generate(prompts, params, use_tqdm=False)]
    assert outs == [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]


def test_dabba_quantize_awq_refuses_gemma(checkpoints, tmp_path, capsys) -> None:
    """dabba's AWQ folds scales into Llama's norms; on Gemma's (1 + w) norms that would be wrong."""
    from dabba.entrypoints.cli import main

    calib = tmp_path / "calib.txt"
    calib.write_text("some text " * 200)
    assert main(["quantize", str(checkpoints["gemma3"].path), str(tmp_path / "q"), "--method", "awq",
                 "--calibration", str(calib)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: method: AWQ folds its scales") and "use --method gptq or rtn" in err
    assert not (tmp_path / "q").exists()


def test_dabba_quantize_gptq_calibrates_gemma_layers(checkpoints, tmp_path) -> None:
    """`dabba quantize --method gptq` drives Gemma 3's layers (two RoPE tables, four norms each)
    through calibration, and the checkpoint it writes loads and generates."""
    from dabba.config import DEMO_MODEL
    from dabba.entrypoints.cli import main

    calib = tmp_path / "calib.txt"
    calib.write_text(open(f"{DEMO_MODEL}/calibration.txt").read()[:20_000])
    src = checkpoints["gemma3"].path
    assert main(["quantize", str(src), str(tmp_path / "q"), "--method", "gptq", "--group-size", "32",
                 "--calibration", str(calib), "--num-samples", "4", "--seq-len", "64"]) == 0
    names = load_file(tmp_path / "q" / "model.safetensors").keys()
    assert "model.layers.2.self_attn.q_norm.weight" in names and "model.layers.0.pre_feedforward_layernorm.weight" in names
    llm = LLM(str(tmp_path / "q"), dtype="float32", kv_cache_memory=2**22)
    out = llm.generate(token_prompts(checkpoints["gemma3"].prompts[3:5]),
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]


# ---- dabba plan ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_plan_counts_the_checkpoint(checkpoints, name) -> None:
    """Weights from ArchConfig alone (four norms a layer, q/k norms, tied or untied head) equal the
    checkpoint's bytes and the engine's; KV per token is 2 L n_kv head_dim p."""
    from dabba.tools.plan import plan

    path = checkpoints[name].path
    arch = ArchConfig.from_hf(path)
    row, = plan(path, 2**22, quantization="none", kv_cache_dtype="auto", dtype="float32").rows
    on_disk = sum(t.numel() * t.element_size() for t in load_file(path / "model.safetensors").values())
    engine = LLM(str(path), dtype="float32", kv_cache_memory=2**22).llm_engine
    assert row.weights_bytes == on_disk == engine.engine_core.model_runner.weight_bytes
    assert ("lm_head.weight" in load_file(path / "model.safetensors")) == (not arch.tie_word_embeddings)
    assert row.kv_bytes_per_token == 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * 4
    # the KV cache as the engine carves it: KV-cache groups, a block of one group's layers
    assert (row.num_blocks, row.kv_bytes_per_block) == (engine.engine_core.cache_layout.num_blocks,
                                                        engine.engine_core.cache_layout.bytes_per_block)
    allocated = sum(t.nbytes for t in {id(c): c for c in engine.engine_core.model_runner.kv_caches}.values())
    assert allocated == row.num_blocks * row.kv_bytes_per_block


def test_plan_of_gemma3_1b_by_hand(tmp_path) -> None:
    """google/gemma-3-1b-it's shape (head_dim 256, one KV head, 26 layers, tied 262144-token
    vocabulary): KV bytes by the formula, and weights equal to transformers' own parameter count."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from dabba.tools.plan import plan

    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_1B))
    p = plan(tmp_path, kv_cache_memory=2**30, max_model_len=4096, quantization="none")
    assert (p.num_layers, p.num_kv_heads, p.head_dim, p.p) == (26, 1, 256, 2)
    rows = {r.kv_cache_dtype: r for r in p.rows}
    assert rows["auto"].kv_bytes_per_token == 2 * 26 * 1 * 256 * 2 == 26624
    assert rows["int8"].kv_bytes_per_token == 2 * 26 * 1 * (256 + 4)
    # KV-cache groups of 4 layers: a pool block is 16 tokens x 4 layers x 1024 bytes; a 4096-token
    # sequence holds 256 blocks in the global group and min(256, cdiv(511 + 4096, 16) + 1) in each
    # of the 6 sliding ones (the default 4096-token step budget); block 0 is the null block
    assert rows["auto"].kv_bytes_per_block == 16 * 4 * 1024
    assert rows["auto"].num_blocks == 2**30 // 65536 and rows["auto"].max_sequences == (16384 - 1) // (7 * 256) == 9
    assert "7 groups of 4 layers; 22 of 26 layers slide (window 512)" in p.render()
    # At 32k with 512-token steps the sliding groups hold 65 blocks each: 6 sequences, not 1
    long = plan(tmp_path, kv_cache_memory=2**30, max_model_len=32768, quantization="none", kv_cache_dtype="auto",
                max_num_batched_tokens=512).rows[0]
    assert long.max_sequences == 16383 // (2048 + 6 * 65) == 6 and 2**30 // (26624 * 32768) == 1
    config = Gemma3TextConfig(**{k: v for k, v in GEMMA3_1B.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    num_params = sum(t.numel() for t in model.parameters())  # the tied head counted once
    per_layer = 1152 * (1024 + 256 + 256) + 1024 * 1152 + 3 * 1152 * 6912 + 4 * 1152 + 2 * 256
    assert num_params == 262144 * 1152 + 26 * per_layer + 1152 == 999_885_952
    assert rows["auto"].weights_bytes == 2 * num_params
