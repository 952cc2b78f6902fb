"""SigLIP's vision tower against transformers' SiglipVisionModel on a tiny random checkpoint: the
patches' last hidden states, from pixel values the image processor made."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from dabba.arch.vision_config import VisionConfig
from dabba.models.siglip import SiglipVisionTower


@pytest.mark.parametrize("hidden_act", ["gelu_pytorch_tanh", "gelu"])
def test_patch_states_equal_transformers(hidden_act, tmp_path) -> None:
    import transformers
    from safetensors.torch import load_file

    config = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=32, patch_size=8, hidden_act=hidden_act)
    torch.manual_seed(0)
    reference = transformers.SiglipVisionModel(config).eval()
    reference.save_pretrained(tmp_path)
    processor = transformers.SiglipImageProcessorPil(size={"height": 32, "width": 32})
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)) for _ in range(3)]
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = reference(pixel_values=pixels).last_hidden_state

    tower = SiglipVisionTower(VisionConfig.from_dict(config.to_dict()))
    tower.load_weights(load_file(tmp_path / "model.safetensors").items())
    with torch.no_grad():
        torch.testing.assert_close(tower(pixels), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="32 x 32"):
        tower(pixels[:, :, :16])


def test_vision_configs_are_checked() -> None:
    with pytest.raises(ValueError, match="clip_vision_model"):
        VisionConfig.from_dict({"model_type": "clip_vision_model"})
    with pytest.raises(ValueError, match="multiple of patch_size"):
        VisionConfig.from_dict({"image_size": 30, "patch_size": 8})
    with pytest.raises(ValueError, match="hidden_act"):
        VisionConfig.from_dict({"hidden_act": "relu"})
