"""Gemma3ForConditionalGeneration (Gemma 3 4B and up): Gemma 3's language model (models/gemma.py)
and its image encoder (models/gemma3_vision.py). An image's embeddings take the places of its
placeholder tokens in the step's embedded tokens (the worker says which rows); the language
model's layers run as for text, the image's tokens attending to each other both ways (the
attention metadata's key_ends, arch ImageInputConfig.bidirectional). The encoder stays in the
model's dtype: quantization applies to the language model's linears only."""
from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable, Iterator

import numpy as np
import torch

from dabba.arch.config import ArchConfig
from dabba.layers.embedding import EmbeddingRows
from dabba.models.gemma import GemmaForCausalLM
from dabba.models.gemma3_vision import PROJECTOR_PREFIXES, TOWER_PREFIXES, Gemma3ImageEncoder
from dabba.quantization.config import QuantConfig

VISION_PREFIXES = (*TOWER_PREFIXES, *PROJECTOR_PREFIXES)
# the language model's tensors, under transformers 5's names and the older ones
LANGUAGE_MODEL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                           ("language_model.lm_head.", "lm_head."))


def language_model_name(name: str) -> str:
    """A checkpoint tensor's name as a text model's checkpoint would have it."""
    for theirs, ours in LANGUAGE_MODEL_PREFIXES:
        if name.startswith(theirs):
            return ours + name.removeprefix(theirs)
    return name


class Gemma3ForConditionalGeneration(GemmaForCausalLM):
    def __init__(self, cfg: ArchConfig, max_position: int, quant_config: QuantConfig | None = None) -> None:
        super().__init__(cfg, max_position, quant_config)
        assert cfg.images is not None, "a vision-language config"
        self.vision = Gemma3ImageEncoder(cfg.images.vision, cfg.images.projector)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                image_embeds: EmbeddingRows | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, image_embeds)

    def encode_images(self, images: list[Any]) -> list[torch.Tensor]:
        """Each image's pixel values ([3, size, size] arrays, multimodal/image_processor.py) ->
        its embeddings [tokens_per_image, hidden]."""
        pixels = torch.from_numpy(np.stack(images)).to(self.vision.mm_input_projection_weight)
        return list(self.vision(pixels))

    def checkpoint_parameters(self) -> list[str]:
        return [name for name in super().checkpoint_parameters() if not name.startswith("vision.")]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     on_loaded: Callable[[str, Hashable], None] | None = None) -> None:
        """The language model's tensors through GemmaForCausalLM's loading; the encoder's (a few
        hundred MB at most, held until the stream ends) then into the encoder."""
        vision: list[tuple[str, torch.Tensor]] = []

        def language() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(VISION_PREFIXES):
                    vision.append((name, tensor))
                else:
                    yield language_model_name(name), tensor

        super().load_weights(language(), on_loaded)
        self.vision.load_weights(vision)
