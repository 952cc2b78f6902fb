"""Images under tensor parallelism (worker processes): every rank holds the whole vision tower and
computes the same embeddings (the scheduler output carries each image's pixels to every rank),
its share of the language model; greedy tokens and prompt logprobs equal one rank's."""
from __future__ import annotations

import pytest
import torch

from dabba import LLM, SamplingParams
from tests.multimodal.test_gemma3_images import PROMPTS, images, prompt_logprobs, tiny_gemma3
from tests.multimodal.test_llava import PROMPTS as LLAVA_PROMPTS
from tests.multimodal.test_llava import tiny_llava
from tests.multimodal.test_qwen2_5_vl import PROMPTS as QWEN_PROMPTS
from tests.multimodal.test_qwen2_5_vl import tiny_qwen2_5_vl

FAMILIES = {"gemma3": (tiny_gemma3, PROMPTS), "llava": (tiny_llava, LLAVA_PROMPTS),
            "qwen2_5_vl": (tiny_qwen2_5_vl, QWEN_PROMPTS)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_images_under_tensor_parallelism_equal_one_rank(family, tmp_path) -> None:
    make, prompts = FAMILIES[family]
    path = make(tmp_path / "m")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    requests = [{"prompt": p, "multi_modal_data": {"image": images(n)}} for n, p in prompts.items()]
    whole = LLM(str(path), dtype="float32").generate(requests, params, use_tqdm=False)
    split = LLM(str(path), dtype="float32", tensor_parallel_size=2).generate(requests, params, use_tqdm=False)
    for a, b in zip(whole, split):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(prompt_logprobs(b), prompt_logprobs(a), rtol=0, atol=1e-4)
