"""The native layer loop (csrc/decode_cpu.cpp) against the Python layers it stands in for: the same
kernels in the same order, so greedy tokens and their logprobs must be bit-identical, for dense
bf16 and float32, load-time INT8, INT4 and W8A8, q/k/v biases (Qwen2), partial rotary (Phi-3), q/k
norms (Qwen3, OLMoE, Gemma 3), mixtures of experts, Gemma's norms, GeGLU, soft caps and RoPE
tables, 8-bit KV caches (int8, fp8) and batches of one and many. The model runner chooses the path
once (``native_layer_loop``): these tests observe which layers ran (a forward hook on a decoder layer fires only in Python) and the
reason it logs."""
from __future__ import annotations

import logging
import re

import pytest

from dabba import LLM, SamplingParams
from dabba.ops.native import load_cpu_ops
from tests.conftest import token_prompts

pytestmark = pytest.mark.skipif(not load_cpu_ops(), reason="native CPU kernels cannot be built here")


def generate(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs]) for o in outs]


def count_python_layer_calls(llm: LLM) -> list[int]:
    """A forward hook on the first decoder layer: it fires once per step the Python layers run."""
    calls = [0]
    layer = llm.llm_engine.engine_core.model_runner.model.model.layers[0]
    layer.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("family, dtype, quantization, kv_cache_dtype", [
    ("llama", "bfloat16", None, "auto"), ("llama", "float32", None, "auto"), ("llama", "bfloat16", "int8", "auto"),
    ("llama", "bfloat16", "int4", "auto"), ("qwen2", "bfloat16", None, "auto"), ("mistral", "bfloat16", "int4", "auto"),
    ("phi3", "bfloat16", None, "auto"), ("phi3", "float32", "int8", "auto"),  # 24 of 32 dims rotate, longrope
    # 8-bit KV caches: GQA 2:1 and 4:1 with a 40-key window (mistral), float32 and bf16
    ("llama", "bfloat16", None, "int8"), ("llama", "float32", None, "fp8"), ("mistral", "bfloat16", None, "fp8"),
    ("qwen2", "float32", "int8", "int8"),
    # q/k norms per head (qwen3) and over all heads (olmoe); mixtures of experts, every linear form
    ("qwen3", "bfloat16", None, "auto"), ("qwen3", "float32", "int8", "auto"),
    ("mixtral", "bfloat16", None, "auto"), ("mixtral", "float32", None, "auto"), ("mixtral", "bfloat16", "int8", "auto"),
    ("qwen3moe", "bfloat16", "int4", "auto"), ("qwen3moe", "bfloat16", None, "int8"),
    ("olmoe", "bfloat16", None, "auto"), ("olmoe", "bfloat16", "int4", "auto"), ("olmoe", "float32", "int8", "auto"),
    # Gemma: (1 + w) norms around attention and MLP, GeGLU, sliding layers between global ones;
    # Gemma 2 soft-caps the scores, Gemma 3 norms q/k per head and rotates its sliding layers by
    # their own RoPE base
    ("gemma2", "bfloat16", None, "auto"), ("gemma2", "float32", "int8", "auto"), ("gemma2", "bfloat16", None, "fp8"),
    ("gemma3", "bfloat16", None, "auto"), ("gemma3", "float32", None, "auto"), ("gemma3", "bfloat16", "int4", "int8"),
    # W8A8: rounded activations, the gated MLP's activation in the epilogue (SwiGLU, GeGLU), experts
    ("llama", "bfloat16", "w8a8", "auto"), ("qwen2", "float32", "w8a8", "int8"), ("gemma2", "bfloat16", "w8a8", "auto"),
    ("mixtral", "bfloat16", "w8a8", "auto"),
])
def test_native_loop_is_bit_identical_to_the_python_layers(checkpoints, family, dtype, quantization,
                                                           kv_cache_dtype) -> None:
    ckpt = checkpoints[family]
    # no prefix caching: both engines must prefill every prompt in full
    kwargs = dict(dtype=dtype, quantization=quantization, kv_cache_memory=2**22, enable_prefix_caching=False,
                  kv_cache_dtype=kv_cache_dtype)
    native, python = (LLM(str(ckpt.path), native_layer_loop=setting, **kwargs) for setting in ("on", "off"))
    native_calls, python_calls = count_python_layer_calls(native), count_python_layer_calls(python)
    for batch in (1, 6, 13):  # 13: past both GEMVs, into the bf16 and INT8 GEMMs
        prompts = (ckpt.prompts * 2)[:batch]
        assert generate(native, prompts) == generate(python, prompts), batch
    assert native_calls == [0]  # every step ran in C++
    assert python_calls[0] >= 3 * 12  # every step ran the Python layers (prompt + 11 decodes, or more)


def test_auto_takes_the_native_loop_where_it_applies_and_says_why(checkpoints, dabba_log) -> None:
    llama = LLM(str(checkpoints["llama"].path), kv_cache_memory=2**22)
    runner = llama.llm_engine.engine_core.model_runner
    assert runner.native_loop is not None
    assert runner.layer_loop_reason == "native_layer_loop='auto', and every layer has a native form"
    assert any(r.getMessage() == f"Layers run in the native loop (csrc/decode_cpu.cpp): {runner.layer_loop_reason}"
               for r in dabba_log)
    calls = count_python_layer_calls(llama)
    generate(llama, checkpoints["llama"].prompts[:2])
    assert calls == [0]


@pytest.mark.parametrize("family, options, reason", [
    ("llama", {"kv_cache_dtype": "int8", "attention_backend": "torch_ref"},
     "the TorchRefBackend attention backend (the loop reads the CPU backend's cache)"),
    ("llama", {"attention_backend": "torch_ref"},
     "the TorchRefBackend attention backend (the loop reads the CPU backend's cache)"),
    ("llama", {"native_layer_loop": "off"}, "native_layer_loop='off'"),
])
def test_without_a_native_form_every_step_runs_the_python_layers(checkpoints, dabba_log, family, options,
                                                                 reason) -> None:
    llm = LLM(str(checkpoints[family].path), kv_cache_memory=2**22, **options)
    runner = llm.llm_engine.engine_core.model_runner
    assert runner.native_loop is None and runner.layer_loop_reason == reason
    assert any(r.levelno == logging.INFO and r.getMessage() == f"Layers run in Python: {reason}" for r in dabba_log)
    calls = count_python_layer_calls(llm)
    out = llm.generate(token_prompts(checkpoints[family].prompts[:2]),
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    assert calls[0] >= 4  # the prompt step and three decodes, at least, went through the hooked layer


def test_on_refuses_a_model_it_cannot_run_exactly(checkpoints) -> None:
    with pytest.raises(ValueError, match=r"native_layer_loop='on', but the TorchRefBackend attention backend "
                                         r"\(the loop reads the CPU backend's cache\); use 'auto' or 'off'"):
        LLM(str(checkpoints["gemma3"].path), kv_cache_memory=2**22, attention_backend="torch_ref",
            native_layer_loop="on")
    with pytest.raises(ValueError, match="native_layer_loop must be one of"):
        LLM(str(checkpoints["llama"].path), kv_cache_memory=2**22, native_layer_loop="yes")


def test_a_layer_that_declares_no_native_form_runs_in_python_and_the_log_says_why(checkpoints, dabba_log,
                                                                                  monkeypatch) -> None:
    """The loop takes each family's declared forms (layers/native_form.py) and probes nothing: a
    decoder layer that declares none, with its reason, runs the whole model in Python."""
    from dabba.layers.native_form import NoNativeForm
    from dabba.models.llama import LlamaDecoderLayer

    reason = "a decoder layer with an op the loop has no kernel for (declared by this test)"

    def no_native_form(layer):
        raise NoNativeForm(reason)

    monkeypatch.setattr(LlamaDecoderLayer, "native_form", no_native_form)
    runner = LLM(str(checkpoints["qwen3"].path), kv_cache_memory=2**22).llm_engine.engine_core.model_runner
    assert runner.native_loop is None and runner.layer_loop_reason == reason
    assert any(r.getMessage() == f"Layers run in Python: {reason}" for r in dabba_log)
    with pytest.raises(ValueError, match=re.escape(f"native_layer_loop='on', but {reason};")):
        LLM(str(checkpoints["qwen3"].path), kv_cache_memory=2**22, native_layer_loop="on")


def test_each_family_declares_its_layers_forms(checkpoints) -> None:
    def forms(family: str) -> list:
        return LLM(str(checkpoints[family].path), kv_cache_memory=2**22).llm_engine.engine_core.model_runner.model \
            .native_layers()

    llama, gemma2, olmoe, mixtral = forms("llama"), forms("gemma2"), forms("olmoe"), forms("mixtral")
    assert llama[0].qk_norm is None and llama[0].pre_mlp_norm is None and llama[0].mlp.moe is None
    assert [f.attention.sliding_window for f in gemma2] == [40, None, 40]  # layers 0 and 2 slide
    assert [f.rope_table for f in gemma2] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert all(f.pre_mlp_norm is not None and f.post_mlp_norm is not None for f in gemma2)
    assert olmoe[0].qk_norm.whole and olmoe[0].mlp.moe is not None and len(olmoe[0].linears) == 2
    assert len(mixtral[0].expert_linears) == 2 * 6  # each of its 6 experts' gate_up and down

