"""A prompt's images, in the front end: each image's mark in the prompt grows into the model's
image sequence, and each image becomes its encoder input and a hash of its content.

Gemma 3's, as transformers' Gemma3Processor writes it: a prompt marks an image with
<start_of_image> (its chat template writes one per image part), which becomes
"\\n\\n<start_of_image>" + tokens_per_image x <image_soft_token> + "<end_of_image>\\n\\n"; the text
is tokenized after that, so the newlines merge with their neighbours as they do in transformers.
LLaVA's (LlavaProcessor's): the mark is the image token itself, repeated tokens_per_image times.
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
from dabba.multimodal.image_processor import ImageProcessorConfig, preprocess
from dabba.multimodal.media import to_rgb


@dataclass(frozen=True)
class ImagePrompt:
    config: ImageInputConfig
    processor: ImageProcessorConfig
    start_text: str  # what marks an image in a prompt's text
    start_token_id: int  # the same, in token ids
    sequence_text: str  # what each mark becomes
    sequence_ids: tuple[int, ...]  # the same, for prompts given as token ids

    @classmethod
    def build(cls, config: ImageInputConfig, processor: ImageProcessorConfig, tokenizer: Tokenizer) -> "ImagePrompt":
        def text(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False)

        n, image = config.tokens_per_image, config.image_token_id
        if config.image_start_token_id is None:  # LLaVA
            return cls(config, processor, text(image), image, text(image) * n, (image,) * n)
        start, end, around = config.image_start_token_id, config.image_end_token_id, config.around
        sequence = f"{around}{text(start)}{text(image) * n}{text(end)}{around}"
        around_ids = tuple(tokenizer.encode(around, add_special_tokens=False)) if around else ()
        return cls(config, processor, text(start), start, sequence,
                   (*around_ids, start, *[image] * n, end, *around_ids))

    def expand_text(self, text: str, num_images: int) -> str:
        found = text.count(self.start_text)
        if found != num_images:
            raise InvalidRequest("multi_modal_data", f"the prompt marks {found} images ({self.start_text!r} each) but "
                                                     f"{num_images} were given")
        return text.replace(self.start_text, self.sequence_text)

    def expand_ids(self, token_ids: list[int], num_images: int) -> list[int]:
        """Each start token grown into the image sequence's ids; ids that hold the images'
        placeholders already (as the chat APIs send them) as they are."""
        runs = _runs(token_ids, self.config.image_token_id, self.config.tokens_per_image)
        if runs and len(runs) == num_images and all(r.length == self.config.tokens_per_image for r in runs):
            return token_ids
        found = token_ids.count(self.start_token_id)
        if found != num_images:
            raise InvalidRequest("multi_modal_data", f"the prompt marks {found} images (token {self.start_token_id} "
                                                     f"each) but {num_images} were given")
        expanded: list[int] = []
        for token_id in token_ids:
            expanded.extend(self.sequence_ids if token_id == self.start_token_id else (token_id,))
        return expanded

    def features(self, token_ids: list[int], images: list[Image.Image]) -> list[MultiModalFeature]:
        """Each image's placeholders in the expanded prompt, its pixel values and content hash."""
        n = self.config.tokens_per_image
        ranges = _runs(token_ids, self.config.image_token_id, n)
        if len(ranges) != len(images) or any(r.length != n for r in ranges):
            raise InvalidRequest("prompt", f"the prompt's own image tokens ({self.sequence_text.strip()[:40]}...) "
                                           "do not match its images: mark each image once, and write no image "
                                           "tokens of your own")
        features = []
        for image, position in zip(images, ranges):
            rgb = to_rgb(image)
            digest = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode())
            digest.update(rgb.tobytes())
            features.append(MultiModalFeature(digest.hexdigest(), position, preprocess(rgb, self.processor)))
        return features


def image_prompt(arch: ArchConfig, model_dir: Path, tokenizer: Tokenizer) -> ImagePrompt | None:
    """A vision-language model's ImagePrompt (its image processor's config read), else None."""
    if arch.images is None:
        return None
    return ImagePrompt.build(arch.images, ImageProcessorConfig.from_checkpoint(model_dir), tokenizer)


def _runs(token_ids: list[int], token_id: int, n: int) -> list[PlaceholderRange]:
    """The runs of ``token_id`` in ``token_ids``, a run of a multiple of ``n`` split into runs of
    ``n`` (LLaVA's images side by side: nothing between their placeholders)."""
    runs: list[PlaceholderRange] = []
    start = None
    for i, t in enumerate([*token_ids, None]):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            length = i - start
            pieces = length // n if length % n == 0 else 1
            runs += [PlaceholderRange(start + k * (length // pieces), length // pieces) for k in range(pieces)]
            start = None
    return runs


def prompt_images(data: Any) -> list[Image.Image]:
    """multi_modal_data's images (vLLM's form: {"image": image or [image, ...]}), PIL images."""
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise InvalidRequest("multi_modal_data", 'multi_modal_data must be {"image": a PIL image or a list of them}')
    images = data.get("image", [])
    images = [images] if isinstance(images, Image.Image) else images
    if not isinstance(images, (list, tuple)) or not all(isinstance(i, Image.Image) for i in images):
        raise InvalidRequest("multi_modal_data", "multi_modal_data['image'] must be a PIL image or a list of them")
    return list(images)
