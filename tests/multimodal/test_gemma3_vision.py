"""Gemma 3's image encoder (SigLIP tower + multimodal projector) against transformers'
Gemma3ForConditionalGeneration.get_image_features on a tiny random checkpoint."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from dabba.arch.vision_config import Gemma3ProjectorConfig, VisionConfig
from dabba.models.gemma3_vision import Gemma3ImageEncoder
from dabba.multimodal.image_processor import ImageProcessorConfig, preprocess


def test_image_embeddings_equal_transformers(tmp_path) -> None:
    import transformers
    from safetensors.torch import load_file

    text = transformers.Gemma3TextConfig(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=24)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=32, patch_size=8)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=290, boi_token_index=291, eoi_token_index=292)
    torch.manual_seed(0)
    reference = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers initialises the projector's weight and norm to zeros
        for p in reference.model.multi_modal_projector.parameters():
            p.normal_(std=0.5)
    reference.save_pretrained(tmp_path)
    processor = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor.save_pretrained(tmp_path)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((40, 50), (90, 30))]
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = reference.model.get_image_features(pixel_values=pixels).pooler_output

    cfg = config.to_dict()
    vision_cfg = VisionConfig.from_dict(cfg["vision_config"])
    encoder = Gemma3ImageEncoder(vision_cfg, Gemma3ProjectorConfig.from_dict(cfg, vision_cfg))
    encoder.load_weights(load_file(tmp_path / "model.safetensors").items())
    ours_pixels = torch.from_numpy(np.stack([preprocess(i, ImageProcessorConfig.from_checkpoint(tmp_path))
                                             for i in images]))
    torch.testing.assert_close(ours_pixels, pixels, rtol=0, atol=1e-6)
    with torch.no_grad():
        out = encoder(ours_pixels)
    assert out.shape == (2, 4, 48)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_projector_shapes_are_checked() -> None:
    vision = VisionConfig.from_dict({"image_size": 32, "patch_size": 8})
    with pytest.raises(ValueError, match="square"):
        Gemma3ProjectorConfig.from_dict({"mm_tokens_per_image": 3, "text_config": {"hidden_size": 8}}, vision)
    with pytest.raises(ValueError, match="divides"):
        Gemma3ProjectorConfig.from_dict({"mm_tokens_per_image": 9, "text_config": {"hidden_size": 8}}, vision)
    with pytest.raises(ValueError, match="hidden_size"):
        Gemma3ProjectorConfig.from_dict({"mm_tokens_per_image": 4, "text_config": {}}, vision)
