"""YaRN RoPE scaling (Qwen2.5/Qwen3 long context): dabba's frequencies and attention factor equal
transformers' own for each way a config spells them, a tiny Qwen2 with YaRN generates
transformers' greedy tokens on prompts past its original window, and llama.cpp's converter's
GGUF file of it (rope.scaling.type yarn) generates them too."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dabba import LLM, SamplingParams
from dabba.arch.config import ArchConfig
from dabba.layers.rotary import rope_inv_freq
from tests.conftest import INIT_STD, hf_greedy, make_prompts, token_prompts
from tests.gguf_families import LLAMA_CPP, converter_view, make_gguf
from tools.tiny_checkpoint import make_checkpoint

YARNS = {
    "factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "betas, no truncation": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128,
                             "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
    "mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
               "mscale_all_dim": 0.707},
    "attention factor": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                         "attention_factor": 1.3},
    "no factor": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("name", YARNS)
def test_frequencies_and_attention_factor_are_transformers(name) -> None:
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_theta": 10000.0, **YARNS[name]}
    fields = dict(hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=512,
                  num_hidden_layers=1, num_key_value_heads=2, intermediate_size=64, vocab_size=64)
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](Qwen2Config(rope_parameters=rope, **fields), "cpu")
    arch = ArchConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], "rope_parameters": rope, **fields})
    assert arch.rope_scaling.attention_factor == pytest.approx(attention, rel=1e-12)
    assert torch.equal(rope_inv_freq(32, 10000.0, arch.rope_scaling, 512), inv_freq)


@pytest.fixture(scope="module")
def qwen2_yarn(tmp_path_factory):
    """A tiny Qwen2 whose window of 64 positions YaRN stretches fourfold, and transformers' greedy
    continuations of prompts that outrun it."""
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(tmp_path_factory.mktemp("qwen2-yarn"), "Qwen2ForCausalLM", initializer_range=INIT_STD,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                           max_position_embeddings=512, rope_parameters={"rope_theta": 10000.0, **YARNS["factor"]})
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [p for p in make_prompts(model.config.vocab_size) if len(p) > 40][:4]
    return path, prompts, hf_greedy(model, prompts, 32)


def generate(model: str, prompts: list[list[int]]) -> list[list[int]]:
    outs = LLM(model, dtype="float32").generate(token_prompts(prompts),
                                                SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_a_yarn_model_generates_transformers_greedy_tokens(qwen2_yarn) -> None:
    path, prompts, reference = qwen2_yarn
    assert generate(str(path), prompts) == reference


def test_its_gguf_file_says_yarn_and_generates_them_too(qwen2_yarn, tmp_path) -> None:
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        if os.environ.get("CI"):
            pytest.fail(f"{LLAMA_CPP} is missing: run scripts/peer-llamacpp.sh")
        pytest.skip("llama.cpp's converter is not unpacked (scripts/peer-llamacpp.sh)")
    path, prompts, reference = qwen2_yarn
    gguf = make_gguf(converter_view("qwen2", Path(path), tmp_path / "view"), tmp_path, ["f32"])["f32"]
    from dabba.models.gguf_checkpoint import gguf_model_dir

    rope = json.loads((gguf_model_dir(gguf) / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == 64
    assert generate(str(gguf), prompts) == reference
