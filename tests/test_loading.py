"""Checkpoint loading: formats, refusals with clear errors, dtypes, config normalisation, tokenizer."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest
import torch
from safetensors.torch import load_file, save_file

from dabba import LLM
from dabba.arch.config import ArchConfig
from dabba.engine.tokenizer import Tokenizer
from tests.conftest import Checkpoint


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_sharded_checkpoint_loads(checkpoints) -> None:
    path = checkpoints["mistral"].path
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "fixture should be sharded"
    llm = LLM(str(path), dtype="float32")
    assert llm.llm_engine.resolved.arch.architecture == "MistralForCausalLM"


def test_refuses_pickled_weights(checkpoints, tmp_path) -> None:
    path = copy_checkpoint(checkpoints["llama"].path, tmp_path / "ck")
    state = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    torch.save(state, path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickled weights.*pytorch_model.bin"):
        LLM(str(path))


def test_unsupported_architecture_is_named(checkpoints, tmp_path) -> None:
    path = copy_checkpoint(checkpoints["llama"].path, tmp_path / "ck")
    edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(str(path))


def test_remote_code_is_refused(checkpoints, tmp_path) -> None:
    path = copy_checkpoint(checkpoints["llama"].path, tmp_path / "ck")
    edit_config(path, architectures=["MyForCausalLM"], auto_map={"AutoModelForCausalLM": "modeling_my.MyForCausalLM"})
    with pytest.raises(ValueError, match="remote code"):
        LLM(str(path))


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}}, "rope_scaling type 'dynamic'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config 'bitsandbytes'"),
])
def test_unsupported_config_is_named(checkpoints, tmp_path, change, message) -> None:
    path = copy_checkpoint(checkpoints["llama"].path, tmp_path / "ck")
    edit_config(path, **change)
    with pytest.raises(ValueError, match=message):
        LLM(str(path))


def test_missing_and_unexpected_tensors(checkpoints, tmp_path) -> None:
    path = copy_checkpoint(checkpoints["llama"].path, tmp_path / "ck")
    state = load_file(path / "model.safetensors")
    state.pop("model.layers.1.self_attn.k_proj.weight")
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors.*layers\.1\.self_attn\.qkv_proj\.weight#k"):
        LLM(str(path))
    state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(48, 96)
    state["model.layers.0.extra.weight"] = torch.zeros(3)
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected tensors.*model\.layers\.0\.extra\.weight"):
        LLM(str(path))


@pytest.mark.parametrize("dtype, expected", [("auto", torch.float32), ("bfloat16", torch.bfloat16),
                                             ("float16", torch.float16), ("float32", torch.float32)])
def test_dtype(checkpoints, dtype, expected) -> None:
    ckpt: Checkpoint = checkpoints["qwen3"]
    llm = LLM(str(ckpt.path), dtype=dtype)
    runner = llm.llm_engine.engine_core.model_runner
    assert runner.model.lm_head.weight.dtype == expected
    assert runner.kv_caches[0].dtype == expected
    out = llm.generate({"prompt_token_ids": ckpt.prompts[5]}, _greedy(16), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 16
    if expected == torch.float32:
        assert out.outputs[0].token_ids == ckpt.reference[5][:16]


def _greedy(n: int):
    from dabba import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_old_style_rope_config_normalises_the_same() -> None:
    new = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2,
           "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}, "dtype": "bfloat16"}
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "dtype")}
    old.update(rope_theta=500.0, rope_scaling={"type": "linear", "factor": 2.0}, torch_dtype="bfloat16")
    a, b = ArchConfig.from_dict(new), ArchConfig.from_dict(old)
    assert a == b
    assert (a.head_dim, a.num_key_value_heads, a.rope_theta, a.rope_scaling.factor) == (4, 2, 500.0, 2.0)
    assert a.torch_dtype == "bfloat16"


def test_qwen2_has_qkv_bias_without_o_bias() -> None:
    cfg = ArchConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 8,
                                "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2})
    assert (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm) == (True, False, False)


@pytest.mark.parametrize("arch, extra", [
    ("MistralForCausalLM", {"sliding_window": 40}), ("MistralForCausalLM", {"sliding_window": None}),
    ("Phi3ForCausalLM", {"sliding_window": 48}),
    ("Qwen2ForCausalLM", {"sliding_window": 40}),  # use_sliding_window off: no window
    ("Qwen2ForCausalLM", {"sliding_window": 40, "use_sliding_window": True, "max_window_layers": 1}),
    ("Qwen3ForCausalLM", {"sliding_window": 40, "use_sliding_window": True, "max_window_layers": 2}),
])
def test_per_layer_sliding_windows_follow_transformers(arch, extra) -> None:
    """Each layer's window as transformers' config would mask it: Mistral and Phi-3 every layer,
    Qwen2/3 only with use_sliding_window and then the layers from max_window_layers on."""
    import transformers

    from tools.tiny_checkpoint import ARCH_CONFIGS

    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 3,
            "num_attention_heads": 2}
    cfg = ArchConfig.from_dict({"architectures": [arch], **base, **extra})
    hf = getattr(transformers, ARCH_CONFIGS[arch])(**base, **extra)
    expected = [hf.sliding_window if getattr(hf, "layer_types", None) is None or t == "sliding_attention" else None
                for t in (getattr(hf, "layer_types", None) or [None] * 3)]
    assert [cfg.layer_sliding_window(i) for i in range(3)] == expected
    assert cfg.sliding_window in (None, 40, 48)


def test_tokenizer_matches_transformers(checkpoints) -> None:
    from transformers import AutoTokenizer

    path = checkpoints["llama"].path
    ours, theirs = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    for text in ["Hello world", "Return the JSON object.\n  indented\ttab", "ünïcödé ✓ 漢字", ""]:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_id == theirs.eos_token_id and ours.bos_token_id == theirs.bos_token_id
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is JSON?"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# A template with what real ones use (Qwen3's, Llama 3.x's, Mistral's, Gemma 3's): namespace()
# across loops, loop controls, reverse slices, tests (is string, is defined, is false), tojson with
# its arguments, raise_exception, {% generation %}, tools, tool calls with object arguments,
# earlier thinking (reasoning_content) and a template variable (enable_thinking).
RICH_TEMPLATE = """
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages[::-1] %}{% if m.role == 'user' %}{% set ns.last_user = messages | length - 1 - loop.index0 %}{% break %}{% endif %}{% endfor %}
{%- if tools %}<tools>{% for t in tools %}{{ t | tojson(indent=2) }}{% if not loop.last %},{% endif %}{% endfor %}</tools>\n{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' and not loop.first %}{{ raise_exception('the system message must come first') }}{% endif %}
{%- if m.role == 'assistant' %}<|assistant|>{% generation %}
{%- if m.reasoning_content is string and loop.index0 > ns.last_user %}<think>{{ m.reasoning_content }}</think>{% endif %}
{{- m.content }}{% for c in m.tool_calls or [] %}<call>{{ c.function.arguments | tojson(sort_keys=true) }}</call>{% continue %}{% endfor %}
{%- endgeneration %}{% else %}<|{{ m.role }}|>{{ m.content }}{% endif %}{{ '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{% endif %}"""


def test_chat_templates_render_as_transformers_renders_them(checkpoints) -> None:
    from transformers import AutoTokenizer

    path = checkpoints["llama"].path
    ours, theirs = Tokenizer(path, chat_template=RICH_TEMPLATE), AutoTokenizer.from_pretrained(path)
    theirs.chat_template = RICH_TEMPLATE
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"unit": "c", "city": "é"}}}
    conversations = [
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], {}),
        ([{"role": "user", "content": "Hi"}], {"enable_thinking": False}),
        ([{"role": "user", "content": "Weather?"},
          {"role": "assistant", "content": "", "reasoning_content": "a tool", "tool_calls": [call]},
          {"role": "tool", "tool_call_id": "c1", "content": "-3"},
          {"role": "assistant", "content": "Cold.", "reasoning_content": "done"}], {"tools": tools}),
    ]
    for messages, kwargs in conversations:
        for generation_prompt in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt, **kwargs) == \
                theirs.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs)
    with pytest.raises(jinja2.TemplateError, match="the system message must come first"):
        ours.apply_chat_template([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}])


def test_chat_template_from_tokenizer_config(checkpoints, tmp_path) -> None:
    path = copy_checkpoint(checkpoints["llama"].path, tmp_path / "ck")
    template = (path / "chat_template.jinja").read_text()
    (path / "chat_template.jinja").unlink()
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer(path).chat_template == template
