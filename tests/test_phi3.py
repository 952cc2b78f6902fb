"""Phi-3 (Phi-3/3.5-mini, Phi-4-mini): its RoPE (partial rotary, longrope and the short/long choice)
against transformers' tables, fused checkpoint tensors, quantized loads and config refusals.
Greedy parity with transformers runs in tests/test_parity.py over the "phi3" checkpoint."""
from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from dabba import LLM, SamplingParams
from dabba.arch.config import ArchConfig
from dabba.layers.rotary import RotaryEmbedding
from tests.conftest import token_prompts
from tests.test_loading import copy_checkpoint, edit_config

SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8, 4.6, 5.5, 6.5, 7.6]
LONG = [1.2, 1.9, 2.7, 3.6, 4.8, 6.0, 7.7, 9.5, 11.0, 14.0, 17.0, 21.0]


def phi3_config(**rope):
    from transformers import Phi3Config

    return Phi3Config(vocab_size=64, hidden_size=96, intermediate_size=64, num_hidden_layers=1, num_attention_heads=3,
                      num_key_value_heads=1, max_position_embeddings=512, original_max_position_embeddings=64,
                      rope_parameters={"rope_theta": 10000.0, **rope})


@pytest.mark.parametrize("rope", [
    dict(rope_type="longrope", partial_rotary_factor=0.75, short_factor=SHORT, long_factor=LONG),
    dict(rope_type="longrope", partial_rotary_factor=1.0, short_factor=SHORT + LONG[:4], long_factor=LONG + SHORT[:4]),
    dict(rope_type="longrope", partial_rotary_factor=0.75, short_factor=SHORT, long_factor=LONG, attention_factor=1.5),
    dict(rope_type="default", partial_rotary_factor=0.75),
], ids=["partial", "full", "attention_factor", "default"])
@pytest.mark.parametrize("seq_len", [40, 64, 65, 300])
def test_rope_tables_equal_transformers(rope, seq_len) -> None:
    """transformers picks the long factors for a forward over more than original_max_position_embeddings
    (64) positions, else the short ones; dabba picks by its max_model_len: over seq_len positions the
    two must agree bit for bit, the attention factor included."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = phi3_config(**rope)
    theirs = Phi3RotaryEmbedding(config)
    positions = torch.arange(seq_len)
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions[None])
    arch = ArchConfig.from_dict({**config.to_dict(), "architectures": ["Phi3ForCausalLM"]})
    ours = RotaryEmbedding(arch.rotary_dim or arch.head_dim, seq_len, arch.rope_theta, arch.rope_scaling)
    our_cos, our_sin = ours.cos_sin(positions, torch.float32)
    assert our_cos.shape == (seq_len, 24 if rope["partial_rotary_factor"] == 0.75 else 32)
    assert torch.equal(our_cos, cos[0]) and torch.equal(our_sin, sin[0])
    if rope["rope_type"] == "longrope":
        expected = rope.get("attention_factor", math.sqrt(1 + math.log(512 / 64) / math.log(64)))
        assert arch.rope_scaling.attention_factor == pytest.approx(expected)


def test_older_phi_configs_normalise_the_same() -> None:
    """Phi-4-mini's config.json (partial_rotary_factor and rope_theta at the top, rope_scaling) and
    Phi-3.5's "su" name what transformers 5 writes as rope_parameters."""
    new = {**phi3_config(rope_type="longrope", partial_rotary_factor=0.75, short_factor=SHORT,
                         long_factor=LONG).to_dict(), "architectures": ["Phi3ForCausalLM"]}
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(rope_theta=10000.0, partial_rotary_factor=0.75,
               rope_scaling={"type": "su", "short_factor": SHORT, "long_factor": LONG})
    a, b = ArchConfig.from_dict(new), ArchConfig.from_dict(old)
    assert a == b
    assert (a.head_dim, a.rotary_dim, a.rope_scaling.rope_type, a.rope_scaling.original_max_position_embeddings,
            a.rope_scaling.factor) == (32, 24, "longrope", 64, 8.0)


def test_partial_rotary_is_refused_where_transformers_ignores_it() -> None:
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="partial_rotary_factor != 1 for LlamaForCausalLM"):
        ArchConfig.from_dict(cfg)


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "unsupported rope_scaling type 'dynamic' for Phi3ForCausalLM"),
    ({"rope_type": "linear", "factor": 2.0}, "unsupported rope_scaling type 'linear' for Phi3ForCausalLM"),
    ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG[:5]},
     r"longrope's long_factor must be a list of rotary_dim / 2 = 12 numbers"),
    ({"rope_type": "longrope", "partial_rotary_factor": 0.59375, "short_factor": SHORT, "long_factor": LONG},
     r"partial_rotary_factor=0.59375 of head_dim 32 rotates an odd number of dims \(19\)"),
])
def test_unsupported_rope_is_refused(checkpoints, tmp_path, rope, message) -> None:
    path = copy_checkpoint(checkpoints["phi3"].path, tmp_path / "ck")
    edit_config(path, rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.75, **rope})
    with pytest.raises(ValueError, match=message):
        LLM(str(path))


def test_the_long_or_short_choice_is_logged(checkpoints, dabba_log) -> None:
    path = str(checkpoints["phi3"].path)
    # max_position_embeddings; the sliding window (448) no longer caps it: attention slides
    assert LLM(path, kv_cache_memory=2**22).llm_engine.model_info.max_model_len == 512
    short = LLM(path, kv_cache_memory=2**22, max_model_len=64)
    messages = [r.getMessage() for r in dabba_log if r.levelno == logging.INFO and "longrope" in r.getMessage()]
    assert messages == [
        "longrope: the long factors for every sequence (max_model_len 512 > original_max_position_embeddings 64); "
        "transformers uses the short ones for sequences of at most 64 tokens",
        "longrope: the short factors (max_model_len 64 <= original_max_position_embeddings 64), as transformers "
        "for sequences this short",
    ]  # (the checkpoint's short and long factors are equal: test_rope_tables_equal_transformers tells them apart)
    assert short.llm_engine.model_info.max_model_len == 64


def split_checkpoint(src, dst):
    """The same weights as separate q/k/v and gate/up tensors, as Llama checkpoints store them."""
    path = copy_checkpoint(src, dst)
    state = load_file(path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    for name in [n for n in state if n.endswith("qkv_proj.weight") or n.endswith("gate_up_proj.weight")]:
        fused = state.pop(name)
        if "qkv_proj" in name:
            parts = dict(zip(("q_proj", "k_proj", "v_proj"), fused.split([q, kv, kv])))
        else:
            parts = dict(zip(("gate_proj", "up_proj"), fused.chunk(2)))
        for part, tensor in parts.items():
            state[name.replace(name.split(".")[-2], part)] = tensor.contiguous()
    save_file(state, path / "model.safetensors")
    return path


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_fused_tensors_load_as_their_shards_would(checkpoints, tmp_path, quantization) -> None:
    """qkv_proj and gate_up_proj load whole into the merged weight: the same parameters (quantized
    after loading, for INT8 and INT4) as loading q/k/v and gate/up one by one, and the same tokens."""
    ckpt = checkpoints["phi3"]
    split = split_checkpoint(ckpt.path, tmp_path / "split")
    kwargs = dict(dtype="float32", quantization=quantization, kv_cache_memory=2**22)
    fused_llm, split_llm = LLM(str(ckpt.path), **kwargs), LLM(str(split), **kwargs)
    fused_state = fused_llm.llm_engine.engine_core.model_runner.model.state_dict()
    split_state = split_llm.llm_engine.engine_core.model_runner.model.state_dict()
    assert fused_state.keys() == split_state.keys()
    assert all(torch.equal(fused_state[k], split_state[k]) for k in fused_state)
    qkv = fused_llm.llm_engine.engine_core.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert type(qkv.quant_method).__name__ == {None: "UnquantizedLinearMethod", "int8": "Int8RTNMethod",
                                                "int4": "Int4RTNMethod"}[quantization]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = token_prompts(ckpt.prompts[4:8])
    outs = [o.outputs[0].token_ids for o in fused_llm.generate(prompts, params, use_tqdm=False)]
    assert outs == [o.outputs[0].token_ids for o in split_llm.generate(prompts, params, use_tqdm=False)]
    if quantization is None:
        assert outs == [ref[:8] for ref in ckpt.reference[4:8]]


def test_a_missing_fused_tensor_is_named(checkpoints, tmp_path) -> None:
    path = copy_checkpoint(checkpoints["phi3"].path, tmp_path / "ck")
    state = load_file(path / "model.safetensors")
    state.pop("model.layers.1.mlp.gate_up_proj.weight")
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors.*layers\.1\.mlp\.gate_up_proj\.weight#0"):
        LLM(str(path))


def test_dabba_quantize_replaces_the_fused_tensors(checkpoints, tmp_path) -> None:
    """`dabba quantize` of a fused checkpoint writes the merged layers' quantized shards and no
    longer copies the fused float tensors beside them (the loader would refuse them as unexpected)."""
    from dabba.config import DEMO_MODEL
    from dabba.entrypoints.cli import main

    calib = tmp_path / "calib.txt"
    calib.write_text(open(f"{DEMO_MODEL}/calibration.txt").read()[:30_000])
    out = tmp_path / "gptq"
    assert main(["quantize", str(checkpoints["phi3"].path), str(out), "--method", "gptq", "--group-size", "32",
                 "--calibration", str(calib), "--num-samples", "4", "--seq-len", "64"]) == 0
    names = load_file(out / "model.safetensors").keys()
    assert "model.layers.0.self_attn.q_proj.qweight" in names and "model.layers.1.mlp.up_proj.qweight" in names
    assert not [n for n in names if "qkv_proj" in n or "gate_up_proj" in n]
    llm = LLM(str(out), dtype="float32", kv_cache_memory=2**22)
    out = llm.generate(token_prompts(checkpoints["phi3"].prompts[:2]), SamplingParams(temperature=0, max_tokens=4,
                                                                                      ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]


def test_plan_counts_the_checkpoint(checkpoints) -> None:
    """`dabba plan` counts Phi-3's weights from ArchConfig alone: the checkpoint's bytes, as loaded."""
    from dabba.tools.plan import plan

    path = checkpoints["phi3"].path
    row, = plan(path, 2**22, quantization="none", kv_cache_dtype="auto", dtype="float32").rows
    on_disk = sum(t.numel() * t.element_size() for t in load_file(path / "model.safetensors").values())
    engine = LLM(str(path), dtype="float32", kv_cache_memory=2**22).llm_engine
    assert row.weights_bytes == on_disk == engine.engine_core.model_runner.weight_bytes
    assert row.kv_bytes_per_token == 2 * 2 * 1 * 32 * 4  # K and V, 2 layers, 1 KV head of 32, float32
