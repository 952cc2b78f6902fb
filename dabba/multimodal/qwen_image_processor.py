"""Qwen2.5-VL's image preparation (transformers' Qwen2VLImageProcessor): each image resized to
the nearest multiple of patch_size x merge_size a side whose pixel count lies in min_pixels ..
max_pixels (smart_resize), rescaled and normalized as any processor (image_processor.py), then cut
into flat patches in the order the tower reads them: merge groups of patches, row by row, each
patch its channels x temporal_patch_size frames (a still image repeated) x its pixels."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from dabba.multimodal.image_processor import ImageProcessorConfig, checkpoint_processor_config, preprocess

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200  # smart_resize refuses longer strips


@dataclass(frozen=True)
class VisionPatches:
    """One image as the tower reads it: ``patches`` [grid_t * grid_h * grid_w, patch values]
    float32, in merge-group order; ``grid`` (frames, patch rows, patch columns)."""

    patches: np.ndarray
    grid: tuple[int, int, int]


@dataclass(frozen=True)
class QwenImageProcessorConfig:
    pixels: ImageProcessorConfig  # resample, rescale, mean/std (its size set per image)
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "preprocessor_config.json") -> "QwenImageProcessorConfig":
        size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {}
        values = {"min_pixels": cfg.get("min_pixels", size.get("shortest_edge", 56 * 56)),
                  "max_pixels": cfg.get("max_pixels", size.get("longest_edge", 28 * 28 * 1280)),
                  **{k: cfg.get(k, default) for k, default in (("patch_size", 14), ("temporal_patch_size", 2),
                                                               ("merge_size", 2))}}
        bad = [k for k, v in values.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        if bad:
            raise ValueError(f"{source}: {', '.join(bad)} must be positive integers")
        if values["min_pixels"] > values["max_pixels"]:
            raise ValueError(f"{source}: min_pixels must not exceed max_pixels")
        rest = {k: v for k, v in cfg.items() if k not in ("size", "default_to_square")}
        pixels = ImageProcessorConfig.from_dict({"image_mean": list(OPENAI_CLIP_MEAN), "image_std": list(OPENAI_CLIP_STD),
                                                 "resample": 3, **rest, "do_resize": False}, source)
        return cls(pixels, **values)

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> "QwenImageProcessorConfig":
        return cls.from_dict(*checkpoint_processor_config(model_dir))

    def check(self, patch_size: int, temporal_patch_size: int, merge_size: int) -> None:
        """The tower's patching must be this processor's."""
        ours = (self.patch_size, self.temporal_patch_size, self.merge_size)
        if ours != (patch_size, temporal_patch_size, merge_size):
            raise ValueError(f"the image processor's patch_size, temporal_patch_size, merge_size {ours} differ from "
                             f"the vision tower's {(patch_size, temporal_patch_size, merge_size)}")

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """transformers' smart_resize: the size an image is resized to."""
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise ValueError(f"an image of {width} x {height} pixels: its aspect ratio must be under "
                             f"{MAX_ASPECT_RATIO}")
        factor = self.patch_size * self.merge_size
        h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def num_tokens(self, image: Image.Image) -> int:
        """The language model's tokens for ``image``: one per merge group of patches."""
        height, width = self.resized(image.height, image.width)
        return height * width // (self.patch_size * self.merge_size) ** 2

    def prepare(self, image: Image.Image) -> VisionPatches:
        height, width = self.resized(image.height, image.width)
        values = preprocess(image, dataclasses.replace(self.pixels, size=(height, width)))  # [C, H, W]
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        channels, grid_h, grid_w = values.shape[0], height // p, width // p
        patches = values.reshape(channels, grid_h // m, m, p, grid_w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
        return VisionPatches(np.ascontiguousarray(patches).reshape(grid_h * grid_w, channels * t * p * p),
                             (1, grid_h, grid_w))
