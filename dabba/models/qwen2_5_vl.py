"""Qwen2_5_VLForConditionalGeneration: a Qwen2 language model whose rotary turns by M-RoPE
positions (layers/rotary.MRotaryEmbedding, worker/mrope_positions.py) and Qwen2.5-VL's vision
tower (models/qwen2_5_vision.py), each image encoded at its own size. Image tokens attend causally,
as the language model's others do, so prefill chunks may cut through an image."""
from __future__ import annotations

from typing import Any, Generator

import torch

from dabba.arch.config import ArchConfig
from dabba.models.llama import LlamaForCausalLM
from dabba.models.qwen2_5_vision import Qwen2_5VisionTower
from dabba.models.vision_language import VisionLanguageModel
from dabba.quantization.config import QuantConfig


class Qwen2_5_VLForConditionalGeneration(VisionLanguageModel, LlamaForCausalLM):
    def __init__(self, cfg: ArchConfig, max_position: int, quant_config: QuantConfig | None = None) -> None:
        super().__init__(cfg, max_position, quant_config)
        assert cfg.images is not None and cfg.images.mrope, "a Qwen2.5-VL config"
        self.vision = Qwen2_5VisionTower(cfg.images.vision)

    def encode_steps(self, image: Any, chunk_rows: int | None) -> Generator[float, None, torch.Tensor]:
        """An image's VisionPatches (multimodal/qwen_image_processor.py) -> its embeddings, in units."""
        return (yield from self.vision.steps(image, chunk_rows))
