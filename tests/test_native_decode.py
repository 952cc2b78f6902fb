"""The native decode loop (csrc/decode_cpu.cpp) against the Python layers it replaces: the same
kernels in the same order, so greedy tokens and their logprobs must be bit-identical, for dense
bf16 and float32, load-time INT8 and INT4, q/k/v biases (Qwen2) and batches of one and many."""
from __future__ import annotations

import pytest

from dabba import LLM, SamplingParams
from dabba.native import load_cpu_ops
from tests.conftest import token_prompts

pytestmark = pytest.mark.skipif(not load_cpu_ops(), reason="native CPU kernels cannot be built here")


def generate(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("family, dtype, quantization", [
    ("llama", "bfloat16", None), ("llama", "float32", None), ("llama", "bfloat16", "int8"),
    ("llama", "bfloat16", "int4"), ("qwen2", "bfloat16", None), ("mistral", "bfloat16", "int4"),
])
@pytest.mark.parametrize("batch", [1, 6, 13])  # 13: past both GEMVs, into the bf16 and INT8 GEMMs
def test_native_decode_is_bit_identical_to_python(checkpoints, family, dtype, quantization, batch) -> None:
    ckpt = checkpoints[family]
    # no prefix caching: the second run must prefill exactly as the first did
    llm = LLM(str(ckpt.path), dtype=dtype, quantization=quantization, kv_cache_memory=2**22,
              enable_prefix_caching=False)
    model = llm.llm_engine.model_runner.model.model
    assert model.native_decoder is not None
    prompts = (ckpt.prompts * 2)[:batch]
    native = generate(llm, prompts)
    model.native_decoder = None  # the Python layers
    assert generate(llm, prompts) == native


def test_models_and_caches_without_a_native_form_decode_in_python(checkpoints) -> None:
    qwen3 = LLM(str(checkpoints["qwen3"].path), kv_cache_memory=2**22)  # per-head q/k norm
    assert qwen3.llm_engine.model_runner.model.model.native_decoder is None
    int8_kv = LLM(str(checkpoints["llama"].path), kv_cache_dtype="int8", kv_cache_memory=2**22)
    runner = int8_kv.llm_engine.model_runner
    assert runner.model.model.native_decoder is not None  # built, but the reference backend's layout:
    assert runner.backend.native_inputs(None) is None  # every step stays in Python
    out = int8_kv.generate(token_prompts(checkpoints["llama"].prompts[:2]),
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
