"""Gemma 3's multimodal checkpoints (4B and up) serving text: the language model from text_config
and the language_model tensors, against transformers' whole model."""
from __future__ import annotations

import torch
from safetensors.torch import load_file

from dabba import LLM, SamplingParams
from dabba.arch.config import ArchConfig
from tests.conftest import token_prompts


def test_a_multimodal_gemma3_checkpoint_serves_text_as_transformers_does(tmp_path) -> None:
    """Gemma3ForConditionalGeneration (4B and up): its language model from text_config and the
    language_model tensors (the vision tower's and the projector's into its image encoder); greedy
    tokens of text prompts equal transformers' on the whole model. As transformers saves it (language_model.model.*,
    vision_tower.*) and under the names of its modules (model.language_model.*, model.vision_tower.*)."""
    import transformers
    from safetensors.torch import save_file

    from tools.tiny_checkpoint import save_byte_level_tokenizer

    vocab = save_byte_level_tokenizer(tmp_path / "v5", 1024, "docstrings")
    text = transformers.Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                         layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                         max_position_embeddings=256, initializer_range=0.1)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, image_size=32, patch_size=8)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3,
                                       bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path / "v5")
    transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(tmp_path / "v5")
    prompts = [[0, 5, 17, 300, 42, 9, 81, 600, 3, 77, 12, 5], [0, 900, 14]]
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
            expected.append(out[0, len(prompt):].tolist())
    modules = tmp_path / "modules"
    modules.mkdir()
    for f in (tmp_path / "v5").iterdir():
        if f.name != "model.safetensors":
            (modules / f.name).write_bytes(f.read_bytes())
    saved = load_file(tmp_path / "v5" / "model.safetensors")
    assert any(n.startswith("vision_tower.") for n in saved) and any(n.startswith("language_model.") for n in saved)
    renamed = {(n.replace("language_model.model.", "model.language_model.").replace("vision_tower.", "model.vision_tower.")
                .replace("multi_modal_projector.", "model.multi_modal_projector.")): t for n, t in saved.items()}
    save_file(renamed, modules / "model.safetensors", metadata={"format": "pt"})
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for path in (tmp_path / "v5", modules):
        llm = LLM(str(path), dtype="float32")
        assert llm.llm_engine.model_info.architecture == "Gemma3ForCausalLM"
        assert [o.outputs[0].token_ids for o in llm.generate(token_prompts(prompts), greedy)] == expected


# google/gemma-3-4b-it's config.json as published (transformers 4.50): a text_config of a few sizes,
# the rest left to Gemma3TextConfig's defaults
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3", "torch_dtype": "bfloat16",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}


def test_the_released_4b_config_resolves_as_transformers_reads_it() -> None:
    import transformers

    from dabba.arch.vision_config import Gemma3ProjectorConfig, VisionConfig

    ours = ArchConfig.from_dict(GEMMA3_4B)
    theirs = transformers.Gemma3Config.from_dict(GEMMA3_4B).text_config
    assert ours.vision_language and ours.architecture == "Gemma3ForCausalLM"
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "sliding_window", "max_position_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.query_pre_attn_scalar == theirs.query_pre_attn_scalar
    assert ours.sliding_layers == tuple(t == "sliding_attention" for t in theirs.layer_types)
    assert ours.rope_theta == theirs.rope_parameters["full_attention"]["rope_theta"]
    assert ours.rope_local_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"]
    assert ours.rope_scaling.factor == 8.0 and ours.eos_token_ids == (1, 106) and ours.torch_dtype == "bfloat16"
    vision = VisionConfig.from_dict(GEMMA3_4B["vision_config"])
    assert (vision.num_patches, Gemma3ProjectorConfig.from_dict(GEMMA3_4B, vision).tokens_per_image) == (4096, 256)
