"""Pixel values equal transformers' image processors (their PIL backend, as these machines run
them) on the same images, from the configs they save: SigLIP (a square resize), CLIP (shortest
edge, then a center crop), Gemma 3 (896 x 896); odd sizes, small images the crop pads, RGBA and
grey inputs."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from dabba.multimodal.image_processor import ImageProcessorConfig, preprocess

PROCESSORS = {
    "siglip": ("SiglipImageProcessorPil", {}),
    "clip": ("CLIPImageProcessorPil", {}),
    "gemma3": ("Gemma3ImageProcessorPil", {}),
    "clip-small": ("CLIPImageProcessorPil", {"size": {"shortest_edge": 64}, "crop_size": {"height": 48, "width": 40},
                                             "resample": 2}),
}


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    rgb = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((300, 500), (97, 61))]
    rgba = Image.fromarray(rng.integers(0, 256, (120, 80, 4), dtype=np.uint8), "RGBA")
    grey = Image.fromarray(rng.integers(0, 256, (64, 200), dtype=np.uint8), "L")
    return [*rgb, rgba, grey, Image.new("RGB", (20, 30), (10, 200, 30))]


@pytest.mark.parametrize("name", PROCESSORS)
def test_pixels_equal_transformers(name, tmp_path) -> None:
    import transformers

    class_name, options = PROCESSORS[name]
    reference = getattr(transformers, class_name)(**options)
    reference.save_pretrained(tmp_path)
    cfg = ImageProcessorConfig.from_checkpoint(tmp_path)
    for image in _images():
        expected = reference(images=[image], return_tensors="np")["pixel_values"][0]
        ours = preprocess(image, cfg)
        assert ours.shape == expected.shape and ours.dtype == np.float32
        np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-6)


def test_what_it_cannot_do_is_refused() -> None:
    with pytest.raises(ValueError, match="pan-and-scan"):
        ImageProcessorConfig.from_dict({"do_pan_and_scan": True})
    with pytest.raises(ValueError, match="size"):
        ImageProcessorConfig.from_dict({"size": {"longest_edge": 10}})
    with pytest.raises(ValueError, match="image_std"):
        ImageProcessorConfig.from_dict({"size": {"height": 2, "width": 2}, "image_mean": [0.5] * 3,
                                        "image_std": [0.5, 0, 0.5]})
    with pytest.raises(ValueError, match="resample"):
        ImageProcessorConfig.from_dict({"size": {"height": 2, "width": 2}, "resample": 9, "do_normalize": False})
