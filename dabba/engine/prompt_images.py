"""A prompt's images, in the front end: each image's mark in the prompt grows into the model's
image sequence, and each image becomes its encoder input and a hash of its content.

Gemma 3's, as transformers' Gemma3Processor writes it: a prompt marks an image with
<start_of_image> (its chat template writes one per image part), which becomes
"\\n\\n<start_of_image>" + tokens_per_image x <image_soft_token> + "<end_of_image>\\n\\n"; the text
is tokenized after that, so the newlines merge with their neighbours as they do in transformers.
LLaVA's (LlavaProcessor's): the mark is the image token itself, repeated tokens_per_image times;
Qwen2.5-VL's (its processor's) the same, as many times as the image's size makes (its chat
template writes <|vision_start|><|image_pad|><|vision_end|> per image part).
A prompt given as token ids has each mark replaced by the sequence's ids.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from dabba.arch.config import ArchConfig
from dabba.arch.vision_config import ImageInputConfig
from dabba.core.multimodal import MultiModalFeature, PlaceholderRange
from dabba.engine.tokenizer import Tokenizer
from dabba.errors import InvalidRequest
from dabba.multimodal.image_processor import ImageProcessorConfig
from dabba.multimodal.media import to_rgb
from dabba.multimodal.qwen_image_processor import QwenImageProcessorConfig


ImageProcessor = ImageProcessorConfig | QwenImageProcessorConfig  # each has prepare(image) -> the encoder's input


@dataclass(frozen=True)
class ImagePrompt:
    config: ImageInputConfig
    processor: ImageProcessor
    start_text: str  # what marks an image in a prompt's text
    start_token_id: int  # the same, in token ids
    placeholder_text: str  # one placeholder's text
    before: tuple[str, tuple[int, ...]]  # what precedes an image's placeholders in its sequence: text, ids
    after: tuple[str, tuple[int, ...]]  # what follows them

    @classmethod
    def build(cls, config: ImageInputConfig, processor: ImageProcessor, tokenizer: Tokenizer) -> "ImagePrompt":
        def text(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False)

        image = config.image_token_id
        if config.image_start_token_id is None:  # LLaVA, Qwen2.5-VL: the mark is the placeholder itself
            return cls(config, processor, text(image), image, text(image), ("", ()), ("", ()))
        start, end, around = config.image_start_token_id, config.image_end_token_id, config.around
        around_ids = tuple(tokenizer.encode(around, add_special_tokens=False)) if around else ()
        return cls(config, processor, text(start), start, text(image), (f"{around}{text(start)}", (*around_ids, start)),
                   (f"{text(end)}{around}", (end, *around_ids)))

    def num_tokens(self, image: Image.Image, field: str = "multi_modal_data") -> int:
        """The placeholders ``image`` takes: the model's fixed number, or as its size makes them;
        InvalidRequest(field) for a size the processor refuses (Qwen2.5-VL: a strip too long)."""
        try:
            return self.config.tokens_per_image or self.processor.num_tokens(image)
        except ValueError as e:
            raise InvalidRequest(field, f"{field}: {e}") from None

    def check(self, image: Image.Image, field: str) -> None:
        """What the chat APIs ask of each image part (multimodal/media.ImageSource.check)."""
        self.num_tokens(image, field)

    def sequence_text(self, image: Image.Image) -> str:
        return self.before[0] + self.placeholder_text * self.num_tokens(image) + self.after[0]

    def expand_text(self, text: str, images: list[Image.Image]) -> str:
        pieces = text.split(self.start_text)
        if len(pieces) - 1 != len(images):
            raise InvalidRequest("multi_modal_data", f"the prompt marks {len(pieces) - 1} images ({self.start_text!r} "
                                                     f"each) but {len(images)} were given")
        return pieces[0] + "".join(self.sequence_text(image) + piece for image, piece in zip(images, pieces[1:]))

    def expand_ids(self, token_ids: list[int], images: list[Image.Image]) -> list[int]:
        """Each start token grown into the image sequence's ids; ids that hold the images'
        placeholders already (as the chat APIs send them) as they are."""
        counts = [self.num_tokens(image) for image in images]
        if _placeholders(token_ids, self.config.image_token_id, counts) is not None:
            return token_ids
        found = token_ids.count(self.start_token_id)
        if found != len(images):
            raise InvalidRequest("multi_modal_data", f"the prompt marks {found} images (token {self.start_token_id} "
                                                     f"each) but {len(images)} were given")
        expanded: list[int] = []
        numbers = iter(counts)
        for token_id in token_ids:
            if token_id == self.start_token_id:
                expanded += [*self.before[1], *[self.config.image_token_id] * next(numbers), *self.after[1]]
            else:
                expanded.append(token_id)
        return expanded

    def features(self, token_ids: list[int], images: list[Image.Image]) -> list[MultiModalFeature]:
        """Each image's placeholders in the expanded prompt, its encoder input and content hash."""
        ranges = _placeholders(token_ids, self.config.image_token_id, [self.num_tokens(image) for image in images])
        if ranges is None:
            raise InvalidRequest("prompt", f"the prompt's own image tokens ({self.placeholder_text!r}) do not match "
                                           "its images: mark each image once, and write no image tokens of your own")
        features = []
        for image, position in zip(images, ranges):
            rgb = to_rgb(image)
            digest = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode())
            digest.update(rgb.tobytes())
            features.append(MultiModalFeature(digest.hexdigest(), position, self.processor.prepare(rgb)))
        return features


def image_prompt(arch: ArchConfig, model_dir: Path, tokenizer: Tokenizer) -> ImagePrompt | None:
    """A vision-language model's ImagePrompt (its image processor's config read), else None."""
    images = arch.images
    if images is None:
        return None
    if images.tokens_per_image:
        return ImagePrompt.build(images, ImageProcessorConfig.from_checkpoint(model_dir), tokenizer)
    processor = QwenImageProcessorConfig.from_checkpoint(model_dir)
    vision = images.vision
    processor.check(vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)
    return ImagePrompt.build(images, processor, tokenizer)


def _placeholders(token_ids: list[int], token_id: int, counts: list[int]) -> list[PlaceholderRange] | None:
    """Each image's placeholders: the runs of ``token_id`` in ``token_ids`` cut into the images'
    ``counts`` in order (images side by side: one run, nothing between their placeholders);
    None where they do not add up."""
    ranges: list[PlaceholderRange] = []
    numbers = iter(counts)
    start = None
    for i, t in enumerate([*token_ids, None]):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            while start < i:
                n = next(numbers, None)
                if n is None or start + n > i:
                    return None
                ranges.append(PlaceholderRange(start, n))
                start += n
            start = None
    return ranges if len(ranges) == len(counts) else None


def prompt_images(data: Any) -> list[Image.Image]:
    """multi_modal_data's images (vLLM's form: {"image": image or [image, ...]}), PIL images."""
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise InvalidRequest("multi_modal_data", 'multi_modal_data must be {"image": a PIL image or a list of them}')
    images = data.get("image", [])
    images = [images] if isinstance(images, Image.Image) else images
    if not isinstance(images, (list, tuple)) or not all(isinstance(i, Image.Image) for i in images):
        raise InvalidRequest("multi_modal_data", "multi_modal_data['image'] must be a PIL image or a list of them")
    return list(images)
