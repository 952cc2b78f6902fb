"""Qwen2.5-VL (its windowed vision tower at each image's own size, M-RoPE positions in the language
model) against transformers' Qwen2_5_VLForConditionalGeneration on a tiny random checkpoint: prompt
ids, greedy tokens and prompt logprobs for no image, one and two (one prompt and side by side), on
the reference backend and the native loop, chunks through images, preemption (outputs at M-RoPE's
delta), the prefix cache and the chat path; the image processor pixel for pixel, the tower's
embeddings, and the positions against transformers' get_rope_index."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dabba import LLM, SamplingParams
from dabba.arch.config import ArchConfig
from dabba.config import DEMO_MODEL
from dabba.core.multimodal import MultiModalFeature, PlaceholderRange
from dabba.models.encoder_steps import run_steps
from dabba.multimodal.qwen_image_processor import QwenImageProcessorConfig, VisionPatches
from dabba.worker.mrope_positions import prompt_positions
from tests.multimodal.test_gemma3_images import LOGPROB_ATOL, data_url, images, prompt_logprobs
from tests.multimodal.test_gemma3_images import transformers_reference as gemma3_reference

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPTS = {
    0: "Nothing to see here, only words about parsers.",
    1: f"{IMAGE}Describe it in a few words.",
    2: f"First {IMAGE} then {IMAGE} what changed between them?",
}
SIDE_BY_SIDE = f"{IMAGE}{IMAGE} which is brighter?"
# Qwen2.5-VL's template, without its default system prompt
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for item in m['content'] %}{% if item['type'] == 'image' %}<|vision_start|><|image_pad|>"
            "<|vision_end|>{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>", "<|im_start|>", "<|im_end|>")


def tiny_qwen2_5_vl(out: Path) -> Path:
    """Windows of 2 x 2 merge groups (56 pixels) with a full-attention layer between windowed ones;
    images of 40 x 50 and 90 x 30 pixels become 4 x 6 and 8 x 4 patches (the edge windows short)."""
    import transformers

    from tools.tiny_checkpoint import tokenizer_with_specials

    tok = tokenizer_with_specials(SPECIALS)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                     pad_token="<pad>")
    tokenizer.chat_template = TEMPLATE
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=0, eos_token_id=1)
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                  initializer_range=0.2)
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"], bos_token_id=0,
        eos_token_id=1, pad_token_id=2)
    torch.manual_seed(0)
    transformers.Qwen2_5_VLForConditionalGeneration(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    image_processor().save_pretrained(out)  # (the whole processor wants torchvision for its video half)
    return out


def image_processor(**kwargs):
    import transformers

    return transformers.Qwen2VLImageProcessorPil(**{"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16, **kwargs})


def reference_inputs(checkpoint: Path, prompt: str, pictures: list, special_tokens: bool = True
                     ) -> dict[str, torch.Tensor]:
    """What Qwen2_5_VLProcessor makes of a prompt: each <|image_pad|> repeated as many times as its
    image's merge groups, pixel values and grids from transformers' own image processor
    (``special_tokens``: the tokenizer's BOS, which a chat template's text is encoded without)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    inputs = {}
    if pictures:
        inputs = dict(image_processor()(images=pictures, return_tensors="pt"))
        counts = iter((inputs["image_grid_thw"].prod(-1) // 4).tolist())
        pieces = prompt.split("<|image_pad|>")
        prompt = pieces[0] + "".join("<|image_pad|>" * next(counts) + piece for piece in pieces[1:])
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=special_tokens)])
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids),
            "mm_token_type_ids": (ids == image_token).int()}


def transformers_reference(checkpoint: Path, prompts: dict, special_tokens: bool = True) -> dict:
    """gemma3's transformers_reference over (prompt, images) per key."""
    return gemma3_reference("Qwen2_5_VLForConditionalGeneration", checkpoint, {k: p for k, (p, _) in prompts.items()},
                            lambda key, prompt: reference_inputs(checkpoint, prompt, prompts[key][1], special_tokens))


CASES = {**{n: (p, images(n)) for n, p in PROMPTS.items()}, "side by side": (SIDE_BY_SIDE, images(2))}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def expected(checkpoint) -> dict:
    return transformers_reference(checkpoint, CASES)


@pytest.mark.parametrize("backend, max_num_batched_tokens", [("torch_ref", 4096), ("auto", 4096), ("auto", 7)],
                         ids=["reference", "native", "chunks-through-images"])
def test_greedy_tokens_and_prompt_logprobs_equal_transformers(checkpoint, expected, backend,
                                                              max_num_batched_tokens) -> None:
    llm = LLM(str(checkpoint), dtype="float32", attention_backend=backend, encoder_budget=64,
              max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate([{"prompt": p, "multi_modal_data": {"image": pics}} for p, pics in CASES.values()],
                           params, use_tqdm=False)
    for key, out in zip(CASES, outputs):
        ids, tokens, logprobs = expected[key]
        assert out.prompt_token_ids == ids
        assert list(out.outputs[0].token_ids) == tokens
        torch.testing.assert_close(prompt_logprobs(out), logprobs, rtol=0, atol=LOGPROB_ATOL)
    assert expected[1][1] != transformers_reference(checkpoint, {1: (PROMPTS[1], images(1, seed=5))})[1][1]


def test_image_processor_equals_transformers(checkpoint) -> None:
    """Pixel values and grids as Qwen2VLImageProcessorPil makes them: upscaled to min_pixels,
    downscaled to max_pixels, rounded to 28 a side; a strip of over 200:1 refused."""
    rng = np.random.default_rng(3)
    from PIL import Image

    ours = QwenImageProcessorConfig.from_checkpoint(checkpoint)
    for height, width in ((40, 50), (90, 30), (300, 200), (28, 28), (61, 333)):
        picture = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        theirs = image_processor()(images=[picture], return_tensors="np")
        prepared = ours.prepare(picture)
        assert prepared.grid == tuple(theirs["image_grid_thw"][0])
        np.testing.assert_allclose(prepared.patches, theirs["pixel_values"], rtol=0, atol=1e-6)
        assert ours.num_tokens(picture) == len(prepared.patches) // 4
    with pytest.raises(ValueError, match="aspect ratio"):
        ours.num_tokens(Image.new("RGB", (2010, 10)))


def test_tower_embeddings_equal_transformers(checkpoint) -> None:
    """The windowed tower and merger, image by image, equal transformers' get_image_features."""
    import transformers

    from dabba.models.qwen2_5_vision import Qwen2_5VisionTower

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint).eval()
    tower = Qwen2_5VisionTower(ArchConfig.from_hf(checkpoint).images.vision)
    tower.load_weights(model.state_dict().items())  # (the language model's tensors are not the tower's)
    pictures = images(2) + [images(1, seed=2)[0].resize((150, 120))]
    inputs = image_processor()(images=pictures, return_tensors="pt")
    with torch.no_grad():
        theirs = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
        ours = [tower(QwenImageProcessorConfig.from_checkpoint(checkpoint).prepare(p)) for p in pictures]
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # in units of 5 patches: windows of 16 and images of 24 to 140 patches split across units
    with torch.no_grad():
        in_units = [run_steps(tower.steps(QwenImageProcessorConfig.from_checkpoint(checkpoint).prepare(p), 5))
                    for p in pictures]
    for a, b in zip(in_units, ours, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_positions_equal_get_rope_index(checkpoint) -> None:
    """Text, an image of 4 x 6 patches, text, one of 8 x 4, text: transformers' 3-D positions and
    the delta its decoding adds."""
    import transformers

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint).eval()
    inputs = reference_inputs(checkpoint, PROMPTS[2], images(2))
    theirs, delta = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                               image_grid_thw=inputs["image_grid_thw"])
    ids = inputs["input_ids"][0].tolist()
    image = ids.index(ids[inputs["mm_token_type_ids"][0].tolist().index(1)])
    starts = [i for i in range(len(ids)) if ids[i] == ids[image] and (i == 0 or ids[i - 1] != ids[image])]
    features = [MultiModalFeature(str(i), PlaceholderRange(start, int(grid.prod()) // 4),
                                  VisionPatches(np.zeros(0), tuple(grid.tolist())))
                for i, (start, grid) in enumerate(zip(starts, inputs["image_grid_thw"]))]
    ours, our_delta = prompt_positions(len(ids), features, 2)
    np.testing.assert_array_equal(ours, theirs[:, 0].numpy())
    assert our_delta == int(delta)


def test_preempted_requests_and_a_follow_up_turn(checkpoint) -> None:
    """A KV cache too small for three image prompts and 40 tokens of reply each: preempted requests
    recompute their prompts and outputs (outputs at the prompt's M-RoPE delta) and equal what each
    gets alone. Then a second turn about the same image hits the prefix cache and encodes nothing."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    requests = [{"prompt": PROMPTS[n], "multi_modal_data": {"image": images(n, seed=n)}} for n in (1, 2, 1)]
    requests[2]["multi_modal_data"] = {"image": images(1, seed=7)}
    alone = LLM(str(checkpoint), dtype="float32")
    expected = [alone.generate(r, params, use_tqdm=False)[0].outputs[0].token_ids for r in requests]
    block_bytes = 16 * 2 * 2 * 16 * 4 * 2  # 16 tokens, k and v, 2 kv heads of 16, float32, 2 layers
    tight = LLM(str(checkpoint), dtype="float32", kv_cache_memory=9 * block_bytes, enable_prefix_caching=False,
                image_decode_slowdown=0)
    outputs = tight.generate(requests, params, use_tqdm=False)
    assert tight.get_stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected

    first = f"A long preamble about parsers, tokens and caches, then {IMAGE} what is it?"
    turn1 = alone.generate({"prompt": first, "multi_modal_data": {"image": images(1)}}, params, use_tqdm=False)[0]
    encoded = alone.get_stats().num_images_encoded
    second = {"prompt": first + turn1.outputs[0].text + " And its colour?", "multi_modal_data": {"image": images(1)}}
    turn2 = alone.generate(second, params, use_tqdm=False)[0]
    assert turn2.num_cached_tokens >= 32 and alone.get_stats().num_images_encoded == encoded
    fresh = LLM(str(checkpoint), dtype="float32", enable_prefix_caching=False)
    assert turn2.outputs[0].token_ids == fresh.generate(second, params, use_tqdm=False)[0].outputs[0].token_ids


def test_llm_chat_with_image_parts(checkpoint) -> None:
    """LLM.chat renders the template's <|vision_start|><|image_pad|><|vision_end|> per image part,
    grows each pad to its image's tokens, and generates transformers' greedy tokens."""
    import transformers

    first, second = images(2)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                                       {"type": "text", "text": "Which?"}]}],
                                         tokenize=False, add_generation_prompt=True)
    expected = transformers_reference(checkpoint, {0: (text, [first, second])}, special_tokens=False)[0]
    ours = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(first)}},
                                         {"type": "image_pil", "image_pil": second},
                                         {"type": "text", "text": "Which?"}]}]
    (out,) = LLM(str(checkpoint), dtype="float32").chat(ours, SamplingParams(temperature=0.0, max_tokens=10,
                                                                               ignore_eos=True), use_tqdm=False)
    assert out.prompt_token_ids == expected[0]
    assert list(out.outputs[0].token_ids) == expected[1]


def test_quantization_takes_the_language_model_only(checkpoint, expected) -> None:
    llm = LLM(str(checkpoint), dtype="float32", quantization="int8")
    model = llm.llm_engine.engine_core.model_runner.model
    assert type(model.model.layers[0].self_attn.qkv_proj.quant_method).__name__ != "UnquantizedLinearMethod"
    assert {p.dtype for p in model.vision.parameters()} == {torch.float32}
    out = llm.generate({"prompt": PROMPTS[2], "multi_modal_data": {"image": images(2)}},
                       SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.prompt_token_ids == expected[2][0]
    assert (prompt_logprobs(out) - expected[2][2]).abs().max() < 0.25  # int8 weights: near, not equal


# Qwen2.5-VL-3B-Instruct's config.json as released: the language model's fields at the top level
QWEN2_5_VL_3B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 128000,
    "max_window_layers": 70, "model_type": "qwen2_5_vl", "num_attention_heads": 16, "num_hidden_layers": 36,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936}


def test_the_released_3b_config_resolves_as_transformers_reads_it() -> None:
    import transformers

    theirs = transformers.Qwen2_5_VLConfig(**QWEN2_5_VL_3B)
    arch = ArchConfig.from_dict(QWEN2_5_VL_3B)
    text = theirs.text_config
    assert (arch.architecture, arch.hidden_size, arch.num_hidden_layers, arch.num_key_value_heads, arch.vocab_size,
            arch.rope_theta, arch.tie_word_embeddings, arch.sliding_window, arch.qkv_bias) == \
        ("Qwen2ForCausalLM", text.hidden_size, text.num_hidden_layers, text.num_key_value_heads, text.vocab_size,
         text.rope_parameters["rope_theta"], theirs.tie_word_embeddings, None, True)
    assert arch.rope_scaling.mrope_section == tuple(text.rope_parameters["mrope_section"]) == (16, 24, 24)
    vision = arch.images.vision
    assert (vision.depth, vision.hidden_size, vision.out_hidden_size, vision.window_merges,
            vision.fullatt_block_indexes) == (32, 1280, 2048, 4, (7, 15, 23, 31))
    assert (arch.images.image_token_id, arch.images.tokens_per_image, arch.images.mrope) == (151655, 0, True)
    with pytest.raises(ValueError, match="mrope_section"):
        ArchConfig.from_dict({**QWEN2_5_VL_3B, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 23]}})
    with pytest.raises(ValueError, match="out_hidden_size"):
        ArchConfig.from_dict({**QWEN2_5_VL_3B, "vision_config": {**QWEN2_5_VL_3B["vision_config"],
                                                                 "out_hidden_size": 1024}})


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_an_image_encoded_over_many_steps_beside_a_decoding_stream(family, checkpoint, tmp_path) -> None:
    """image_decode_slowdown just above 1: while a chat stream decodes, the image arriving is
    encoded a unit a step and its prompt a few tokens a step; its tokens, and the stream's, are
    what each gets alone."""
    from tests.multimodal.test_gemma3_images import PROMPTS as GEMMA_PROMPTS
    from tests.multimodal.test_gemma3_images import tiny_gemma3

    path, prompt = (checkpoint, PROMPTS[2]) if family == "qwen2_5_vl" else (tiny_gemma3(tmp_path), GEMMA_PROMPTS[2])
    chat = {"prompt": "Parsers and tokens, again and again."}
    image = {"prompt": prompt, "multi_modal_data": {"image": images(2)}}
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    alone = LLM(str(path), dtype="float32")
    expected = [alone.generate(r, params, use_tqdm=False)[0].outputs[0].token_ids for r in (chat, image)]
    engine = LLM(str(path), dtype="float32", image_decode_slowdown=1.0001).llm_engine
    images_in = engine.engine_core.model_runner.images
    update, units = images_in.update, []

    def counted(sched):
        work = update(sched)
        units.append(work.units)
        return work

    images_in.update = counted
    engine.add_request("chat", chat, params)
    engine.step()  # its prompt: it decodes from here
    engine.add_request("image", image, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    assert [tokens["chat"], tokens["image"]] == [list(t) for t in expected]
    assert max(units) == 1 and sum(units) >= 4  # a unit a step: the encodings spread over steps
    assert engine.engine_core.scheduler.encoder.ration.work_seconds is not None


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_the_vision_tower_in_w8a8_when_asked(family, checkpoint, tmp_path) -> None:
    """vision_quantization "w8a8": every plain linear of the encoder in W8A8 (the language model
    as it was), its image embeddings within cosine 0.999 of the float ones, and the images still
    steer the tokens (prompt logprobs near float32's)."""
    from dabba.quantization.w8a8_modules import W8A8Linear
    from tests.multimodal.test_gemma3_images import PROMPTS as GEMMA_PROMPTS
    from tests.multimodal.test_gemma3_images import tiny_gemma3

    path, prompt = (checkpoint, PROMPTS[2]) if family == "qwen2_5_vl" else (tiny_gemma3(tmp_path), GEMMA_PROMPTS[2])
    request = {"prompt": prompt, "multi_modal_data": {"image": images(2)}}
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    runs = {}
    for asked in (None, "w8a8"):
        llm = LLM(str(path), dtype="float32", vision_quantization=asked)
        runner = llm.llm_engine.engine_core.model_runner
        linears = [m for m in runner.model.vision.modules() if isinstance(m, (torch.nn.Linear, W8A8Linear))]
        assert linears and all(isinstance(m, W8A8Linear) == (asked is not None) for m in linears)
        out = llm.generate(request, params, use_tqdm=False)[0]
        runs[asked] = (prompt_logprobs(out), dict(runner.images.embeddings))
    (float_lp, float_rows), (w8a8_lp, w8a8_rows) = runs[None], runs["w8a8"]
    for identifier, rows in float_rows.items():
        cosine = torch.nn.functional.cosine_similarity(rows, w8a8_rows[identifier], dim=-1)
        assert cosine.min() > 0.999, cosine.min()
    gap = (w8a8_lp - float_lp).abs()
    assert gap.max() < 0.5 and gap.mean() < 0.1  # (random tiny models: near, not equal)
    with pytest.raises(ValueError, match="vision_quantization"):
        LLM(str(path), dtype="float32", vision_quantization="int4")
    with pytest.raises(ValueError, match="reads no images"):
        LLM(DEMO_MODEL, vision_quantization="w8a8")


def test_bf16_tower_near_transformers(checkpoint) -> None:
    """In bf16 (native dense attention tiles and the float32 rotation's kernel where the CPU has
    them) the embeddings stay within bf16's rounding of transformers' bf16 tower."""
    import transformers

    from dabba.models.qwen2_5_vision import Qwen2_5VisionTower

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint).eval().to(torch.bfloat16)
    tower = Qwen2_5VisionTower(ArchConfig.from_hf(checkpoint).images.vision)
    tower.load_weights(model.state_dict().items())
    tower = tower.to(torch.bfloat16)
    pictures = images(1, seed=3) + [images(1, seed=4)[0].resize((150, 120))]
    inputs = image_processor()(images=pictures, return_tensors="pt")
    with torch.no_grad():
        theirs = model.model.get_image_features(inputs["pixel_values"].to(torch.bfloat16),
                                                inputs["image_grid_thw"]).pooler_output
        ours = [tower(QwenImageProcessorConfig.from_checkpoint(checkpoint).prepare(p)) for p in pictures]
    for a, b in zip(ours, theirs, strict=True):
        cosine = torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)
        assert cosine.min() > 0.999, cosine.min()
