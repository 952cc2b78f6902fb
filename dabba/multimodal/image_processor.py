"""An image -> the pixel values a vision tower reads, as the checkpoint's preprocessor_config.json
says: resize (to a height and width, or the shortest edge to a length keeping the aspect ratio),
center crop, rescale (1/255), normalize by a mean and std per channel, channels first. Computed as
transformers' PIL backend computes it (Pillow resizes the 8-bit image, numpy does the arithmetic:
rescale in float64 then float32, normalize in float32), so the values equal its own. What a
config asks that this does not do (Gemma 3's pan-and-scan crops, padding) is refused by name."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from dabba.arch.files import read_json_object
from dabba.multimodal.media import to_rgb

# PIL's resampling filters by the number configs write (PILImageResampling)
RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS, 2: Image.Resampling.BILINEAR,
            3: Image.Resampling.BICUBIC, 4: Image.Resampling.BOX, 5: Image.Resampling.HAMMING}
_REFUSED = {"do_pan_and_scan": "pan-and-scan crops", "do_pad": "padding", "do_image_splitting": "image splitting"}


@dataclass(frozen=True)
class ImageProcessorConfig:
    """``size``: (height, width) to resize to, or None; ``shortest_edge``: the length the shorter
    side is resized to, the other kept in proportion (truncated), or None; ``crop``: (height, width)
    of the center crop, or None; ``rescale``: the factor (None: none); ``mean``/``std``: per channel
    (None: no normalization)."""

    size: tuple[int, int] | None = None
    shortest_edge: int | None = None
    resample: int = 2
    crop: tuple[int, int] | None = None
    rescale: float | None = 1 / 255
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    convert_rgb: bool = True

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "preprocessor_config.json") -> "ImageProcessorConfig":
        refused = [what for key, what in _REFUSED.items() if cfg.get(key)]
        if refused:
            raise ValueError(f"{source}: {', '.join(refused)} are not supported")
        size = shortest = crop = None
        if cfg.get("do_resize", True):
            raw = cfg.get("size")
            if isinstance(raw, int):
                square = cfg.get("default_to_square", True)
                raw = {"height": raw, "width": raw} if square else {"shortest_edge": raw}
            if not isinstance(raw, dict):
                raise ValueError(f"{source}: size must be a mapping, got {raw!r}")
            if "height" in raw and "width" in raw:
                size = (_positive(raw["height"], "size.height", source), _positive(raw["width"], "size.width", source))
            elif set(raw) == {"shortest_edge"}:
                shortest = _positive(raw["shortest_edge"], "size.shortest_edge", source)
            else:
                raise ValueError(f"{source}: size {raw!r} is not supported (height and width, or shortest_edge)")
        if cfg.get("do_center_crop", False):
            raw = cfg.get("crop_size")
            raw = {"height": raw, "width": raw} if isinstance(raw, int) else raw
            if not isinstance(raw, dict) or "height" not in raw or "width" not in raw:
                raise ValueError(f"{source}: crop_size must give a height and a width, got {raw!r}")
            crop = (_positive(raw["height"], "crop_size.height", source),
                    _positive(raw["width"], "crop_size.width", source))
        resample = cfg.get("resample", 2)
        if resample not in RESAMPLE:
            raise ValueError(f"{source}: resample {resample!r} is not a PIL filter (0-5)")
        rescale = float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else None
        mean = std = None
        if cfg.get("do_normalize", True):
            mean, std = _channels(cfg.get("image_mean"), "image_mean", source), _channels(cfg.get("image_std"),
                                                                                          "image_std", source)
            if any(s <= 0 for s in std):
                raise ValueError(f"{source}: image_std must be positive, got {std}")
        return cls(size, shortest, resample, crop, rescale, mean, std, bool(cfg.get("do_convert_rgb", True)))

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> "ImageProcessorConfig":
        return cls.from_dict(*checkpoint_processor_config(model_dir))

    def prepare(self, image: Image.Image) -> np.ndarray:
        """What the encoder reads of ``image``: [3, height, width] float32 pixel values."""
        return preprocess(image, self)


def checkpoint_processor_config(model_dir: str | Path) -> tuple[dict[str, Any], str]:
    """The image processor's settings and where they were: preprocessor_config.json, or the
    image_processor of processor_config.json (transformers 5 saves a whole processor there)."""
    path = Path(model_dir) / "preprocessor_config.json"
    if path.is_file():
        return read_json_object(path), str(path)
    path = Path(model_dir) / "processor_config.json"
    if path.is_file():
        image_processor = read_json_object(path).get("image_processor")
        if not isinstance(image_processor, dict):
            raise ValueError(f"{path} has no image_processor mapping")
        return image_processor, f"{path}: image_processor"
    raise ValueError(f"{model_dir} has neither preprocessor_config.json nor processor_config.json, which say how "
                     "its images are prepared")


def _positive(value: Any, name: str, source: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{source}: {name} must be a positive integer, got {value!r}")
    return value


def _channels(value: Any, name: str, source: str) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        value = [value] * 3
    if not isinstance(value, list) or len(value) != 3 or not all(isinstance(v, (int, float)) for v in value):
        raise ValueError(f"{source}: {name} must be three numbers, got {value!r}")
    return tuple(float(v) for v in value)  # type: ignore[return-value]


def preprocess(image: Image.Image, cfg: ImageProcessorConfig) -> np.ndarray:
    """[3, height, width] float32 pixel values."""
    if cfg.convert_rgb:
        image = to_rgb(image)
    if cfg.size is not None:
        image = image.resize((cfg.size[1], cfg.size[0]), resample=RESAMPLE[cfg.resample])
    elif cfg.shortest_edge is not None:
        width, height = image.size
        short, long = min(width, height), max(width, height)
        new_long = int(cfg.shortest_edge * long / short)
        new = (cfg.shortest_edge, new_long) if width <= height else (new_long, cfg.shortest_edge)
        image = image.resize(new, resample=RESAMPLE[cfg.resample])
    pixels = np.asarray(image).transpose(2, 0, 1)  # [3, height, width] uint8
    if cfg.crop is not None:
        pixels = _center_crop(pixels, cfg.crop)
    values = pixels.astype(np.float64) * cfg.rescale if cfg.rescale is not None else pixels
    values = values.astype(np.float32)
    if cfg.mean is not None:
        mean = np.array(cfg.mean, dtype=np.float32)[:, None, None]
        std = np.array(cfg.std, dtype=np.float32)[:, None, None]
        values = (values - mean) / std
    return values


def _center_crop(pixels: np.ndarray, crop: tuple[int, int]) -> np.ndarray:
    """transformers' center_crop: the middle (rounded up and left), zero-padded where the image is smaller."""
    _, height, width = pixels.shape
    crop_height, crop_width = crop
    top, left = (height - crop_height) // 2, (width - crop_width) // 2
    if top >= 0 and left >= 0:
        return pixels[:, top:top + crop_height, left:left + crop_width]
    new_height, new_width = max(crop_height, height), max(crop_width, width)
    padded = np.zeros((pixels.shape[0], new_height, new_width), dtype=pixels.dtype)
    top_pad, left_pad = -(-(new_height - height) // 2), -(-(new_width - width) // 2)
    padded[:, top_pad:top_pad + height, left_pad:left_pad + width] = pixels
    top, left = top + top_pad, left + left_pad
    return padded[:, max(top, 0):max(top, 0) + crop_height, max(left, 0):max(left, 0) + crop_width]
