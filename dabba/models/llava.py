"""LlavaForConditionalGeneration: a CLIP (or SigLIP) tower read at vision_feature_layer, CLIP's class
token dropped ("default"), a two-linear projector with an activation between, and any language
family dabba runs (the text_config's). Its image tokens attend causally, as the language model's
others do, so prefill chunks may cut through an image."""
from __future__ import annotations

import functools
from typing import Generator, Iterable

import torch
from torch import nn

from dabba.arch.config import ArchConfig
from dabba.arch.vision_config import LlavaProjectorConfig, VisionConfig
from dabba.models.encoder_steps import run_steps
from dabba.models.siglip import ACTIVATIONS, SiglipVisionTower
from dabba.models.vision_language import VisionLanguageModel, load_projector, split_vision_tensors
from dabba.quantization.config import QuantConfig


class LlavaImageEncoder(nn.Module):
    def __init__(self, vision: VisionConfig, projector: LlavaProjectorConfig) -> None:
        super().__init__()
        self.projector = projector
        self.vision_tower = SiglipVisionTower(vision)
        text = projector.text_hidden_size
        self.linear_1 = nn.Linear(vision.hidden_size, text, bias=projector.bias)
        self.linear_2 = nn.Linear(text, text, bias=projector.bias)
        self.activation = ACTIVATIONS[projector.activation]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[num_images, 3, size, size] -> [num_images, tokens_per_image, text hidden]."""
        return run_steps(self.steps(pixel_values))

    def steps(self, pixel_values: torch.Tensor, chunk_rows: int | None = None) -> Generator[float, None, torch.Tensor]:
        """forward() in units (models/encoder_steps.py)."""
        states = yield from self.vision_tower.steps(pixel_values, self.projector.num_layers, chunk_rows)
        if self.projector.drop_class_token:
            states = states[:, 1:]
        return self.linear_2(self.activation(self.linear_1(states)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tower, projector = split_vision_tensors(weights)
        self.vision_tower.load_weights(tower)
        params = {f"{linear}.{kind}": getattr(getattr(self, linear), kind) for linear in ("linear_1", "linear_2")
                  for kind in ("weight", "bias") if getattr(getattr(self, linear), kind) is not None}
        load_projector(params, projector)


@functools.cache
def llava_for(language_cls: type[nn.Module]) -> type[nn.Module]:
    """The LLaVA model class over ``language_cls`` (the text_config's family)."""

    def __init__(self, cfg: ArchConfig, max_position: int, quant_config: QuantConfig | None = None) -> None:
        language_cls.__init__(self, cfg, max_position, quant_config)
        assert cfg.images is not None, "a vision-language config"
        self.vision = LlavaImageEncoder(cfg.images.vision, cfg.images.projector)

    return type(f"Llava{language_cls.__name__}", (VisionLanguageModel, language_cls), {"__init__": __init__})
