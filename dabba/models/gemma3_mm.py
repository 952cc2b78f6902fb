"""Gemma3ForConditionalGeneration (Gemma 3 4B and up): Gemma 3's language model (models/gemma.py)
and its image encoder (models/gemma3_vision.py), whose image tokens attend to each other both
ways (the attention metadata's key_ends, arch ImageInputConfig.bidirectional)."""
from __future__ import annotations

from dabba.arch.config import ArchConfig
from dabba.models.gemma import GemmaForCausalLM
from dabba.models.gemma3_vision import Gemma3ImageEncoder
from dabba.models.vision_language import VisionLanguageModel
from dabba.quantization.config import QuantConfig


class Gemma3ForConditionalGeneration(VisionLanguageModel, GemmaForCausalLM):
    def __init__(self, cfg: ArchConfig, max_position: int, quant_config: QuantConfig | None = None) -> None:
        super().__init__(cfg, max_position, quant_config)
        assert cfg.images is not None, "a vision-language config"
        self.vision = Gemma3ImageEncoder(cfg.images.vision, cfg.images.projector)
