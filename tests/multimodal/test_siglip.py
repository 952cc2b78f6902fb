"""SigLIP's vision tower against transformers' SiglipVisionModel on a tiny random checkpoint: the
patches' last hidden states, from pixel values the image processor made."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
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
    with pytest.raises(ValueError, match="dinov2"):
        VisionConfig.from_dict({"model_type": "dinov2"})
    with pytest.raises(ValueError, match="multiple of patch_size"):
        VisionConfig.from_dict({"image_size": 30, "patch_size": 8})
    with pytest.raises(ValueError, match="hidden_act"):
        VisionConfig.from_dict({"hidden_act": "relu"})


@pytest.mark.parametrize("num_layers", [None, 2, 1])
def test_clip_tower_equals_transformers(num_layers) -> None:
    """CLIP's tower (LLaVA's): the class token, the LayerNorm before the layers, quick_gelu; an
    earlier layer's states as transformers' hidden_states[num_layers] (no final LN)."""
    import transformers

    config = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=32, patch_size=8)
    torch.manual_seed(0)
    reference = transformers.CLIPVisionModel(config).eval()
    tower = SiglipVisionTower(VisionConfig.from_dict(config.to_dict()))
    assert tower.config.clip and tower.config.num_positions == 17
    tower.load_weights(reference.state_dict().items())
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = reference(pixel_values=pixels, output_hidden_states=True)
        expected = out.last_hidden_state if num_layers is None else out.hidden_states[num_layers]
        torch.testing.assert_close(tower(pixels, num_layers), expected, rtol=1e-5, atol=1e-5)


def test_bf16_tower_near_transformers() -> None:
    """In bf16 the tower's attention takes the native dense tiles where the CPU has them
    (layers/encoder_attention.dense_attention), head_dim 72 as Gemma 3's: its patch states stay
    within bf16's rounding of transformers' bf16 tower (PyTorch's SDPA)."""
    import transformers

    config = transformers.SiglipVisionConfig(hidden_size=144, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=96, patch_size=8)
    torch.manual_seed(0)
    reference = transformers.SiglipVisionModel(config).eval().to(torch.bfloat16)
    tower = SiglipVisionTower(VisionConfig.from_dict(config.to_dict()))
    tower.load_weights(reference.state_dict().items())
    tower = tower.to(torch.bfloat16)
    pixels = torch.randn(2, 3, 96, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = reference(pixel_values=pixels).last_hidden_state.float()
        ours = tower(pixels).float()
    cosine = F.cosine_similarity(ours.flatten(0, 1), expected.flatten(0, 1), dim=-1)
    assert cosine.min() > 0.999, cosine.min()
