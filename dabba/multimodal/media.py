"""Images from strangers, opened defensively: raw bytes or a base64 ``data:`` URL -> an RGB image,
within a byte limit and a pixel limit that is checked from the header, before any pixel is
decoded (a decompression bomb is refused, never expanded), in the formats vision models are served
(PNG, JPEG, WebP, and a GIF's first frame). Transparency is composited onto white, as
transformers' processors do. A bad image is an InvalidRequest naming the request's part."""
from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from dataclasses import dataclass
from typing import Callable

from PIL import Image, UnidentifiedImageError

from dabba.errors import InvalidRequest
from dabba.multimodal.fetch import UrlPolicy

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<base64>;base64)?,",
                       re.ASCII)


@dataclass(frozen=True)
class ImageLimits:
    """What one image may be: ``max_bytes`` encoded, ``max_pixels`` decoded (width x height)."""

    max_bytes: int = 20 * 2**20
    max_pixels: int = 6000 * 6000

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.max_pixels < 1:
            raise ValueError(f"image limits must be positive, got {self}")


def data_url_bytes(url: str, field: str) -> bytes:
    """A ``data:[mime];base64,...`` URL's bytes; an image's mime type must be image/*."""
    match = _DATA_URL.match(url)
    if match is None or not match.group("base64"):
        raise InvalidRequest(field, f"{field}: expected a base64 data URL (data:image/png;base64,...)")
    mime = match.group("mime")
    if mime is not None and not mime.startswith("image/"):
        raise InvalidRequest(field, f"{field}: a data URL of {mime!r}, not an image")
    try:
        return base64.b64decode(url[match.end():], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(field, f"{field}: the data URL's base64 does not decode") from None


def open_image(data: bytes, field: str, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """The image ``data`` holds, decoded and in RGB; InvalidRequest(field) for anything else."""
    if len(data) > limits.max_bytes:
        raise InvalidRequest(field, f"{field}: the image is {len(data)} bytes; at most {limits.max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = image.size
            if width * height > limits.max_pixels:
                raise InvalidRequest(field, f"{field}: the image is {width}x{height} pixels; at most "
                                            f"{limits.max_pixels} pixels")
            image.seek(0)  # an animation's first frame
            image.load()
    except InvalidRequest:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidRequest(field, f"{field}: the image claims more pixels than Pillow opens (at most "
                                    f"{limits.max_pixels} pixels here)") from None
    except UnidentifiedImageError:
        raise InvalidRequest(field, f"{field}: not an image in a supported format ({', '.join(FORMATS)})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise InvalidRequest(field, f"{field}: the image is corrupt ({e})") from None
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, any transparency composited onto white (transformers' convert_to_rgb)."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


@dataclass(frozen=True)
class ImageSource:
    """Where a request's images may come from and what they may be: base64 data: URLs always,
    http(s) URLs as ``urls`` allows (multimodal/fetch.py)."""

    limits: ImageLimits = ImageLimits()
    urls: UrlPolicy = UrlPolicy()
    # the model's own check of an image (its processor's refusals), InvalidRequest(field) if any
    check: Callable[[Image.Image, str], None] | None = None

    def open(self, url: str, field: str) -> Image.Image:
        if not isinstance(url, str):
            raise InvalidRequest(field, f"{field}: an image URL must be a string")
        if url.startswith("data:"):
            return self.accept(open_image(data_url_bytes(url, field), field, self.limits), field)
        return self.accept(open_image(self.urls.fetch(url, field, self.limits.max_bytes), field, self.limits), field)

    def accept(self, image: Image.Image, field: str) -> Image.Image:
        """``image`` where the model takes it."""
        if self.check is not None:
            self.check(image, field)
        return image
