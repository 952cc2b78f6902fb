"""Images in Gemma 3 prompts, end to end, against transformers' Gemma3ForConditionalGeneration and
Gemma3Processor on a tiny random checkpoint: the prompt's token ids, greedy tokens and prompt
logprobs for prompts with no image, one and two; on the reference backend and the native loop;
with prefill chunks that stop before an image; the encoder cache and the prefix cache (counted)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from PIL import Image

from dabba import LLM, SamplingParams
from dabba.errors import InvalidRequest

PROMPTS = {  # number of images -> prompt
    0: "Nothing to see here, only words about the parser and its tokens.",
    1: "Describe <start_of_image> in a few words.",
    2: "Compare <start_of_image> with this one: <start_of_image> what changed?",
}
LOGPROB_ATOL = 2e-4  # float32, the same weights: the order of summation only
# Gemma 3's chat template, but for its system-prompt handling: image parts write <start_of_image>
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages -%}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' "
    "else message['role']) + '\n' }}{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")


def tiny_gemma3(out: Path) -> Path:
    """A Gemma3ForConditionalGeneration checkpoint with its processor: a byte-level tokenizer
    with Gemma 3's three image tokens, a SigLIP tower on 32 x 32 images, 4 tokens per image."""
    import transformers

    from tools.tiny_checkpoint import tokenizer_with_specials

    tok = tokenizer_with_specials(("<start_of_image>", "<image_soft_token>", "<end_of_image>"))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        extra_special_tokens={"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                              "eoi_token": "<end_of_image>"})
    tokenizer.chat_template = GEMMA3_TEMPLATE
    boi, image, eoi = (tok.token_to_id(t) for t in ("<start_of_image>", "<image_soft_token>", "<end_of_image>"))
    text = transformers.Gemma3TextConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=256,
        initializer_range=0.2)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, image_size=32, patch_size=8)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=image, boi_token_index=boi, eoi_token_index=eoi,
                                       bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers initialises the projector's weight and norm to zeros
        for p in model.model.multi_modal_projector.parameters():
            p.normal_(std=1.0)
    model.save_pretrained(out)
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    transformers.Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                 image_seq_length=4).save_pretrained(out)
    return out


def images(n: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((40, 50), (90, 30))[:n]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny_gemma3(tmp_path_factory.mktemp("gemma3_images"))


def transformers_reference(model_class: str, checkpoint: Path, prompts: dict[Any, str],
                           inputs_of: Callable[[Any, str], dict] | None = None
                           ) -> dict[Any, tuple[list[int], list[int], torch.Tensor]]:
    """transformers' prompt ids, greedy tokens (10) and prompt logprobs, per prompt: its inputs
    as ``inputs_of(key, prompt)`` makes them, else through the checkpoint's own processor with
    images(key) (the key: a number of images)."""
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(checkpoint) if inputs_of is None else None
    model = getattr(transformers, model_class).from_pretrained(checkpoint).eval()
    result = {}
    for key, prompt in prompts.items():
        inputs = (inputs_of(key, prompt) if inputs_of is not None else
                  processor(text=prompt, images=images(key) or None, return_tensors="pt"))
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=10, do_sample=False)
            logits = model(**inputs).logits[0].float()
        ids = inputs["input_ids"][0]
        logprobs = logits[:-1].log_softmax(-1).gather(1, ids[1:, None])[:, 0]
        result[key] = (ids.tolist(), out[0, len(ids):].tolist(), logprobs)
    return result


@pytest.fixture(scope="module")
def expected(checkpoint) -> dict[int, tuple[list[int], list[int], torch.Tensor]]:
    return transformers_reference("Gemma3ForConditionalGeneration", checkpoint, PROMPTS)


def prompt_logprobs(output) -> torch.Tensor:
    ids = output.prompt_token_ids
    return torch.tensor([output.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])


@pytest.mark.parametrize("backend", ["torch_ref", "auto"])
def test_greedy_tokens_and_prompt_logprobs_equal_transformers(checkpoint, expected, backend) -> None:
    """0, 1 and 2 images, each prompt alone and all three in one batch; "auto" runs the CPU
    backend's kernels in the native layer loop (the image tokens' bidirectional attention there)."""
    llm = LLM(str(checkpoint), dtype="float32", attention_backend=backend)
    if backend == "auto":
        assert llm.llm_engine.engine_core.model_runner.native_loop is not None
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, prompt_logprobs=0)
    requests = [{"prompt": p, "multi_modal_data": {"image": images(n)}} for n, p in PROMPTS.items()]
    for outputs in ([llm.generate(r, params, use_tqdm=False)[0] for r in requests],
                    llm.generate(requests, params, use_tqdm=False)):
        for n, out in zip(PROMPTS, outputs):
            ids, tokens, logprobs = expected[n]
            assert out.prompt_token_ids == ids
            assert list(out.outputs[0].token_ids) == tokens
            torch.testing.assert_close(prompt_logprobs(out), logprobs, rtol=0, atol=LOGPROB_ATOL)
    # two images in all (the one-image prompt's is the first of the two), each encoded once
    assert llm.get_stats().num_images_encoded == 2


def test_image_tokens_see_their_whole_image(checkpoint, expected) -> None:
    """Without the image block's bidirectional attention the prompt logprobs after an image move
    far past the tolerance: the comparison above can tell causal from bidirectional."""
    llm = LLM(str(checkpoint), dtype="float32", attention_backend="torch_ref")
    llm.llm_engine.engine_core.model_runner.images.bidirectional = False
    out = llm.generate({"prompt": PROMPTS[2], "multi_modal_data": {"image": images(2)}},
                       SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert (prompt_logprobs(out) - expected[2][2]).abs().max() > 100 * LOGPROB_ATOL


def test_chunks_stop_before_an_image_and_prompts_as_token_ids(checkpoint, expected) -> None:
    """A 12-token step budget: chunks end before an image rather than inside it (its tokens must
    see each other), and the tokens equal transformers'. The same prompt as token ids, each image
    marked by its start token, grows into the same ids."""
    llm = LLM(str(checkpoint), dtype="float32", max_num_batched_tokens=12, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, prompt_logprobs=0)
    tokenizer = llm.get_tokenizer()
    ids, tokens, logprobs = expected[2]
    marked = tokenizer.encode(PROMPTS[2])
    for prompt in ({"prompt": PROMPTS[2]}, {"prompt_token_ids": marked}):
        out = llm.generate({**prompt, "multi_modal_data": {"image": images(2)}}, params, use_tqdm=False)[0]
        assert out.prompt_token_ids == ids
        assert list(out.outputs[0].token_ids) == tokens
        torch.testing.assert_close(prompt_logprobs(out), logprobs, rtol=0, atol=LOGPROB_ATOL)


def test_a_follow_up_turn_about_the_same_image_encodes_nothing(checkpoint) -> None:
    """The second turn's prompt starts with the first's: the prefix cache holds the image's
    blocks (their hashes name the image), so no image is encoded; a different image at the same
    place misses the cache, and the encoder cache alone serves the same image elsewhere."""
    llm = LLM(str(checkpoint), dtype="float32", encoder_cache_memory=4 * 4 * 64 * 4)  # 4 images' rows
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = "A long preamble about parsers, tokens and caches, then <start_of_image> what is it?"
    image = images(1)
    turn1 = llm.generate({"prompt": first, "multi_modal_data": {"image": image}}, params, use_tqdm=False)[0]
    assert llm.get_stats().num_images_encoded == 1
    second = first + turn1.outputs[0].text + " And what colour is it?"
    turn2 = llm.generate({"prompt": second, "multi_modal_data": {"image": image}}, params, use_tqdm=False)[0]
    assert turn2.num_cached_tokens >= 32 and llm.get_stats().num_images_encoded == 1

    other = images(1, seed=1)
    fresh = LLM(str(checkpoint), dtype="float32", enable_prefix_caching=False)
    for prompt, picture in ((second, other), ("Elsewhere: <start_of_image>", image)):
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": picture}}, params, use_tqdm=False)[0]
        alone = fresh.generate({"prompt": prompt, "multi_modal_data": {"image": picture}}, params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert llm.get_stats().num_images_encoded == 2  # the other image; then the first from the encoder cache


def test_bad_image_requests_are_refused_by_name(checkpoint, tmp_path) -> None:
    from tools.tiny_checkpoint import make_checkpoint

    llm = LLM(str(checkpoint), dtype="float32", limit_mm_per_prompt={"image": 1}, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidRequest, match="marks 2 images") as e:
        llm.generate({"prompt": PROMPTS[2], "multi_modal_data": {"image": images(1)}}, params)
    assert e.value.param == "multi_modal_data"
    with pytest.raises(InvalidRequest, match="at most 1") as e:
        llm.generate({"prompt": PROMPTS[2], "multi_modal_data": {"image": images(2)}}, params)
    assert e.value.param == "multi_modal_data"
    with pytest.raises(InvalidRequest, match="PIL image"):
        llm.generate({"prompt": PROMPTS[1], "multi_modal_data": {"image": "cat.png"}}, params)
    with pytest.raises(InvalidRequest, match="own image tokens"):
        llm.generate({"prompt": PROMPTS[1] + "<image_soft_token>", "multi_modal_data": {"image": images(1)}}, params)
    small_steps = LLM(str(checkpoint), dtype="float32", max_num_batched_tokens=3, encoder_budget=16)
    with pytest.raises(InvalidRequest, match="exceeds max_num_batched_tokens"):
        small_steps.generate({"prompt": PROMPTS[1], "multi_modal_data": {"image": images(1)}}, params)
    with pytest.raises(InvalidRequest, match="text only"):
        llm.embed([{"prompt": PROMPTS[1], "multi_modal_data": {"image": images(1)}}], use_tqdm=False)
    text_only = LLM(str(make_checkpoint(tmp_path / "llama")), dtype="float32")
    with pytest.raises(InvalidRequest, match="takes no images"):
        text_only.generate({"prompt": "hello", "multi_modal_data": {"image": images(1)}}, params)
    # the engine goes on
    assert len(llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids) == 2


def data_url(image: Image.Image) -> str:
    import base64
    import io

    out = io.BytesIO()
    image.save(out, format="PNG")  # lossless: the same pixels
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


CHAT_TEXTS = ("Look:", "and", "what differs?")


def test_llm_chat_with_image_parts_equals_transformers_processor(checkpoint) -> None:
    """LLM.chat with image parts (a data: URL and a PIL image) renders, expands and tokenizes as
    transformers' processor.apply_chat_template does, and generates its greedy tokens."""
    import transformers

    first, second = images(2)
    processor = transformers.AutoProcessor.from_pretrained(checkpoint)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(checkpoint).eval()
    theirs = [{"role": "user", "content": [{"type": "text", "text": CHAT_TEXTS[0]}, {"type": "image", "image": first},
                                           {"type": "text", "text": CHAT_TEXTS[1]}, {"type": "image", "image": second},
                                           {"type": "text", "text": CHAT_TEXTS[2]}]}]
    inputs = processor.apply_chat_template(theirs, tokenize=True, return_dict=True, add_generation_prompt=True,
                                           return_tensors="pt")
    with torch.no_grad():
        expected = model.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    ours = [{"role": "user", "content": [
        {"type": "text", "text": CHAT_TEXTS[0]}, {"type": "image_url", "image_url": {"url": data_url(first)}},
        {"type": "text", "text": CHAT_TEXTS[1]}, {"type": "image_pil", "image_pil": second},
        {"type": "text", "text": CHAT_TEXTS[2]}]}]
    llm = LLM(str(checkpoint), dtype="float32")
    (out,) = llm.chat(ours, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert list(out.outputs[0].token_ids) == expected.tolist()
    with pytest.raises(InvalidRequest, match="corrupt|not an image") as e:
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                                           "iVBORw0KGgo="}}]}])
    assert e.value.param == "messages[0][0].content.0.image_url"


def test_a_preempted_request_recomputes_its_images(checkpoint) -> None:
    """A KV cache too small for three image prompts and their replies at once: requests are
    preempted and recomputed (their images encoded again where the encoder cache dropped them),
    and every request's tokens equal what it gets alone."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    requests = [{"prompt": PROMPTS[n], "multi_modal_data": {"image": images(n, seed=n)}} for n in (1, 2, 1)]
    requests[2]["multi_modal_data"] = {"image": images(1, seed=7)}
    alone = LLM(str(checkpoint), dtype="float32")
    expected = [alone.generate(r, params, use_tqdm=False)[0].outputs[0].token_ids for r in requests]
    # a block: 16 tokens of one layer of each KV-cache group (3 groups of one layer), k and v, 2 kv heads of 16, float32
    block_bytes = 16 * 2 * 2 * 16 * 4
    tight = LLM(str(checkpoint), dtype="float32", kv_cache_memory=20 * block_bytes, enable_prefix_caching=False,
                image_decode_slowdown=0)  # (rationed, the later prompts would wait for the first to end)
    outputs = tight.generate(requests, params, use_tqdm=False)
    assert tight.get_stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_quantization_takes_the_language_model_only(checkpoint, expected) -> None:
    """--quantization int8: the language model's linears are quantized, the vision tower and the
    projector keep the model's dtype; the image still reaches the tokens (close to float32's)."""
    llm = LLM(str(checkpoint), dtype="float32", quantization="int8")
    model = llm.llm_engine.engine_core.model_runner.model
    assert type(model.model.layers[0].self_attn.qkv_proj.quant_method).__name__ != "UnquantizedLinearMethod"
    assert {p.dtype for p in model.vision.parameters()} == {torch.float32}
    out = llm.generate({"prompt": PROMPTS[1], "multi_modal_data": {"image": images(1)}},
                       SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.prompt_token_ids == expected[1][0]
    assert (prompt_logprobs(out) - expected[1][2]).abs().max() < 0.25  # int8 weights: near (0.08 here), not equal
