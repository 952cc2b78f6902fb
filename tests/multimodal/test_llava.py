"""LLaVA (a CLIP tower, a two-linear projector, a Llama) against transformers'
LlavaForConditionalGeneration and LlavaProcessor on a tiny random checkpoint: prompt ids, greedy
tokens and prompt logprobs for no image, one and two (side by side too), on the reference backend
and the native loop; prefill chunks that cut through an image (its tokens attend causally); the
chat path as processor.apply_chat_template."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dabba import LLM, SamplingParams
from tests.multimodal.test_gemma3_images import (LOGPROB_ATOL, data_url, images, prompt_logprobs,
                                                  transformers_reference)

PROMPTS = {
    0: "USER: Nothing to see here, only words about parsers. ASSISTANT:",
    1: "USER: <image>\nDescribe it in a few words. ASSISTANT:",
    2: "USER: <image><image>\nWhat changed between them? ASSISTANT:",
}
# llava-hf's shape of template, with the BOS written (as vLLM, the chat path adds no special tokens)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] | upper }}: {% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for item in m['content'] %}{% if item['type'] == 'image' %}<image>\n"
            "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def tiny_llava(out: Path) -> Path:
    import transformers

    from tools.tiny_checkpoint import tokenizer_with_specials

    tok = tokenizer_with_specials(("<image>",))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                     pad_token="<pad>", extra_special_tokens={"image_token": "<image>"})
    tokenizer.chat_template = TEMPLATE
    text = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=256, initializer_range=0.2)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=32, patch_size=8)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.token_to_id("<image>"),
                                      vision_feature_layer=-2, vision_feature_select_strategy="default",
                                      bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # a projector that moves the logits: its output at the text's scale
        for p in model.model.multi_modal_projector.parameters():
            p.normal_(std=0.3)
    model.save_pretrained(out)
    image_processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": 32},
                                                         crop_size={"height": 32, "width": 32})
    transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                                vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                chat_template=TEMPLATE).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def expected(checkpoint):
    return transformers_reference("LlavaForConditionalGeneration", checkpoint, PROMPTS)


@pytest.mark.parametrize("backend, max_num_batched_tokens", [("torch_ref", 4096), ("auto", 4096), ("auto", 10)],
                         ids=["reference", "native", "chunks-through-images"])
def test_greedy_tokens_and_prompt_logprobs_equal_transformers(checkpoint, expected, backend,
                                                              max_num_batched_tokens) -> None:
    llm = LLM(str(checkpoint), dtype="float32", attention_backend=backend, encoder_budget=64,
              max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False)
    assert llm.llm_engine.model_info.architecture == "LlamaForCausalLM"
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate([{"prompt": p, "multi_modal_data": {"image": images(n)}} for n, p in PROMPTS.items()],
                           params, use_tqdm=False)
    for n, out in zip(PROMPTS, outputs):
        ids, tokens, logprobs = expected[n]
        assert out.prompt_token_ids == ids
        assert list(out.outputs[0].token_ids) == tokens
        torch.testing.assert_close(prompt_logprobs(out), logprobs, rtol=0, atol=LOGPROB_ATOL)


def test_chat_with_images_equals_the_processors_template(checkpoint) -> None:
    import transformers

    first, second = images(2)
    processor = transformers.AutoProcessor.from_pretrained(checkpoint)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(checkpoint).eval()
    theirs = [{"role": "user", "content": [{"type": "image", "image": first}, {"type": "image", "image": second},
                                           {"type": "text", "text": "Which is brighter?"}]}]
    inputs = processor.apply_chat_template(theirs, tokenize=True, return_dict=True, add_generation_prompt=True,
                                           return_tensors="pt")
    with torch.no_grad():
        expected = model.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    ours = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(first)}},
                                         {"type": "image_pil", "image_pil": second},
                                         {"type": "text", "text": "Which is brighter?"}]}]
    (out,) = LLM(str(checkpoint), dtype="float32").chat(ours, SamplingParams(temperature=0.0, max_tokens=8,
                                                                               ignore_eos=True), use_tqdm=False)
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert list(out.outputs[0].token_ids) == expected.tolist()
