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


@pytest.mark.parametrize("family", ["gemma3", "llava"])
def test_images_under_tensor_parallelism_equal_one_rank(family, tmp_path) -> None:
    path, prompts = ((tiny_gemma3(tmp_path / "m"), PROMPTS) if family == "gemma3" else
                     (tiny_llava(tmp_path / "m"), LLAVA_PROMPTS))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    requests = [{"prompt": p, "multi_modal_data": {"image": images(n)}} for n, p in prompts.items()]
    whole = LLM(str(path), dtype="float32").generate(requests, params, use_tqdm=False)
    split = LLM(str(path), dtype="float32", tensor_parallel_size=2).generate(requests, params, use_tqdm=False)
    for a, b in zip(whole, split):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(prompt_logprobs(b), prompt_logprobs(a), rtol=0, atol=1e-4)
