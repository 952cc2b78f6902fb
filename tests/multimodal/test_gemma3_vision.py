"""Gemma 3's image encoder (SigLIP tower + multimodal projector) against transformers'
Gemma3ForConditionalGeneration.get_image_features on a tiny random checkpoint."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dabba.arch.vision_config import Gemma3ProjectorConfig, VisionConfig
from dabba.models.encoder_steps import run_steps
from dabba.models.gemma3_vision import Gemma3ImageEncoder
from dabba.multimodal.image_processor import ImageProcessorConfig, preprocess


def test_image_embeddings_equal_transformers(tmp_path) -> None:
    """The tiny Gemma 3 of tests/multimodal/test_gemma3_images.py: pixels as its processor makes
    them, embeddings as get_image_features gives them."""
    import json

    import transformers
    from safetensors.torch import load_file

    from tests.multimodal.test_gemma3_images import images, tiny_gemma3

    path = tiny_gemma3(tmp_path)
    reference = transformers.Gemma3ForConditionalGeneration.from_pretrained(path).eval()
    processor = transformers.AutoProcessor.from_pretrained(path).image_processor
    pixels = processor(images=images(2), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = reference.model.get_image_features(pixel_values=pixels).pooler_output

    cfg = json.loads((path / "config.json").read_text())
    vision_cfg = VisionConfig.from_dict(cfg["vision_config"])
    encoder = Gemma3ImageEncoder(vision_cfg, Gemma3ProjectorConfig.from_dict(cfg, vision_cfg))
    encoder.load_weights(load_file(path / "model.safetensors").items())
    ours_pixels = torch.from_numpy(np.stack([preprocess(i, ImageProcessorConfig.from_checkpoint(path))
                                             for i in images(2)]))
    torch.testing.assert_close(ours_pixels, pixels, rtol=0, atol=1e-6)
    with torch.no_grad():
        out = encoder(ours_pixels)
    assert out.shape == (2, 4, 64)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # in units of 3 patches (the tower's 16 in chunks): 2 phases x 6 chunks x 2 layers, then the end
    steps = encoder.steps(ours_pixels, chunk_rows=3)
    with torch.no_grad():
        units = sum(1 for _ in iter(lambda: next(steps, "end"), "end"))
        in_units = run_steps(encoder.steps(ours_pixels, chunk_rows=3))
    assert units == 2 * 6 * vision_cfg.num_hidden_layers
    torch.testing.assert_close(in_units, out, rtol=1e-5, atol=1e-5)


def test_projector_shapes_are_checked() -> None:
    vision = VisionConfig.from_dict({"image_size": 32, "patch_size": 8})
    with pytest.raises(ValueError, match="square"):
        Gemma3ProjectorConfig.from_dict({"mm_tokens_per_image": 3, "text_config": {"hidden_size": 8}}, vision)
    with pytest.raises(ValueError, match="divides"):
        Gemma3ProjectorConfig.from_dict({"mm_tokens_per_image": 9, "text_config": {"hidden_size": 8}}, vision)
    with pytest.raises(ValueError, match="hidden_size"):
        Gemma3ProjectorConfig.from_dict({"mm_tokens_per_image": 4, "text_config": {}}, vision)
