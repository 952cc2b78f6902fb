"""Images from strangers: formats, data URLs, and every way one can be bad (corrupt, truncated,
too many bytes, a decompression bomb's header, not an image) is an InvalidRequest naming the part."""
from __future__ import annotations

import base64
import io
import zlib

import pytest
from PIL import Image

from dabba.errors import InvalidRequest
from dabba.multimodal.media import ImageLimits, data_url_bytes, open_image

FIELD = "messages[0].content[1].image_url"


def _encoded(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_formats_open_as_rgb(fmt) -> None:
    image = Image.new("RGB", (40, 30), (200, 10, 10))
    opened = open_image(_encoded(image, fmt), FIELD)
    assert opened.mode == "RGB" and opened.size == (40, 30)
    assert abs(opened.getpixel((5, 5))[0] - 200) < 16  # lossy formats come close


def test_transparency_goes_onto_white() -> None:
    image = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    assert open_image(_encoded(image, "PNG"), FIELD).getpixel((0, 0)) == (255, 255, 255)


def test_data_urls() -> None:
    png = _encoded(Image.new("RGB", (2, 2)), "PNG")
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert data_url_bytes(url, FIELD) == png
    for bad, says in [("data:text/plain;base64,aGk=", "not an image"), ("data:image/png,abc", "base64 data URL"),
                      ("data:image/png;base64,@@@", "does not decode"), ("https://x/y.png", "base64 data URL")]:
        with pytest.raises(InvalidRequest, match=says) as e:
            data_url_bytes(bad, FIELD)
        assert e.value.param == FIELD


def _bomb(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height: what Pillow reads before any pixel."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")
    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def test_bad_images_are_refused_naming_the_part() -> None:
    png = _encoded(Image.new("RGB", (64, 64), (1, 2, 3)), "PNG")
    cases = [(b"not an image at all", "not an image"), (png[: len(png) // 2], "corrupt"),
             (_bomb(7000, 7000), "pixels"), (_bomb(100_000, 100_000), "pixels")]  # ours, then Pillow's limit
    for data, says in cases:
        with pytest.raises(InvalidRequest, match=says) as e:
            open_image(data, FIELD)
        assert e.value.param == FIELD
    with pytest.raises(InvalidRequest, match="bytes"):
        open_image(png, FIELD, ImageLimits(max_bytes=100))
    with pytest.raises(InvalidRequest, match="pixels"):
        open_image(png, FIELD, ImageLimits(max_pixels=64 * 63))
    assert open_image(png, FIELD, ImageLimits(max_pixels=64 * 64)).size == (64, 64)
