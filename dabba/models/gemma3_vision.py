"""Gemma 3's image encoder: SigLIP's tower (models/siglip.py), then the multimodal projector
(arch/vision_config.Gemma3ProjectorConfig): each image becomes ``tokens_per_image`` embeddings of
the language model's width, which take the places of the prompt's image tokens."""
from __future__ import annotations

from typing import Generator, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from dabba.arch.vision_config import Gemma3ProjectorConfig, VisionConfig
from dabba.models.encoder_steps import run_steps
from dabba.models.siglip import SiglipVisionTower
from dabba.models.vision_language import load_projector, split_vision_tensors


class Gemma3ImageEncoder(nn.Module):
    def __init__(self, vision: VisionConfig, projector: Gemma3ProjectorConfig) -> None:
        super().__init__()
        self.vision, self.projector = vision, projector
        self.vision_tower = SiglipVisionTower(vision)
        self.mm_soft_emb_norm = nn.Parameter(torch.zeros(vision.hidden_size))
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision.hidden_size, projector.text_hidden_size))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[num_images, 3, image_size, image_size] -> [num_images, tokens_per_image, text hidden]."""
        return run_steps(self.steps(pixel_values))

    def steps(self, pixel_values: torch.Tensor, chunk_rows: int | None = None) -> Generator[float, None, torch.Tensor]:
        """forward() in units (models/encoder_steps.py)."""
        patches = yield from self.vision_tower.steps(pixel_values, chunk_rows=chunk_rows)  # [num_images, patches, hidden]
        num_images, _, hidden = patches.shape
        side = self.vision.image_size // self.vision.patch_size
        kernel = side // int(round(self.projector.tokens_per_image ** 0.5))
        grid = patches.transpose(1, 2).reshape(num_images, hidden, side, side)
        pooled = F.avg_pool2d(grid, kernel).flatten(2).transpose(1, 2)  # [num_images, tokens, hidden]
        x = pooled.float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.vision.layer_norm_eps)
        normed = (normed * (1.0 + self.mm_soft_emb_norm.float())).type_as(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(patches)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The tower's and the projector's tensors of a Gemma3ForConditionalGeneration checkpoint
        (the language model's are not read here)."""
        tower, projector = split_vision_tensors(weights)
        self.vision_tower.load_weights(tower)
        load_projector({"mm_soft_emb_norm.weight": self.mm_soft_emb_norm,
                        "mm_input_projection_weight": self.mm_input_projection_weight}, projector)
