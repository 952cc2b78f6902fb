"""What every vision-language model adds to its language model (a mixin before the language
model's class): an image encoder (``self.vision``: images' inputs -> their embeddings) loaded from
the same checkpoint, and a forward that takes the step's image rows (the worker says which),
which replace their placeholders' embeddings. The language model's layers run as for text."""
from __future__ import annotations

from typing import Any, Callable, Generator, Hashable, Iterable, Iterator

import torch

from dabba.layers.embedding import EmbeddingRows

# where checkpoints keep the encoder: transformers 5 ("model."), and older transformers
TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.visual.", "visual.")  # (visual: Qwen2.5-VL's)
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
VISION_PREFIXES = (*TOWER_PREFIXES, *PROJECTOR_PREFIXES)
# the language model's tensors, under transformers 5's names and the older ones
LANGUAGE_MODEL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                           ("language_model.lm_head.", "lm_head."))


def split_vision_tensors(weights: Iterable[tuple[str, torch.Tensor]]
                         ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """A checkpoint's vision tensors -> the tower's and the projector's, each under its own names."""
    tower, projector = [], {}
    for name, tensor in weights:
        if (prefix := next((p for p in TOWER_PREFIXES if name.startswith(p)), None)) is not None:
            tower.append((name.removeprefix(prefix), tensor))
        elif (prefix := next((p for p in PROJECTOR_PREFIXES if name.startswith(p)), None)) is not None:
            projector[name.removeprefix(prefix)] = tensor
    return tower, projector


def load_projector(params: dict[str, torch.nn.Parameter], tensors: dict[str, torch.Tensor]) -> None:
    """Each projector parameter from the tensor of its checkpoint name; missing, unexpected and
    misshapen tensors fail loudly."""
    unexpected = sorted(set(tensors) - set(params))
    if unexpected:
        raise ValueError(f"checkpoint has unexpected multi_modal_projector tensors: {unexpected}")
    for theirs, ours in params.items():
        if theirs not in tensors:
            raise ValueError(f"checkpoint is missing multi_modal_projector.{theirs}")
        if tensors[theirs].shape != ours.shape:
            raise ValueError(f"multi_modal_projector.{theirs}: {tuple(tensors[theirs].shape)} != {tuple(ours.shape)}")
        ours.data.copy_(tensors[theirs])


def copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """A checkpoint tensor into a vision parameter of its shape."""
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint tensor {tuple(tensor.shape)} != expected {tuple(param.shape)}")
    param.data.copy_(tensor)


def check_complete(params: Iterable[str], loaded: set[str], unexpected: list[str]) -> None:
    """Every vision parameter loaded, no tensor left over."""
    if unexpected:
        raise ValueError(f"checkpoint has unexpected vision tensors: {unexpected[:10]}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing vision tensors: {missing[:10]}")


def language_model_name(name: str) -> str:
    """A checkpoint tensor's name as a text model's checkpoint would have it."""
    for theirs, ours in LANGUAGE_MODEL_PREFIXES:
        if name.startswith(theirs):
            return ours + name.removeprefix(theirs)
    return name


class VisionLanguageModel:
    """Mixed in before a language model class (LlamaForCausalLM's contract); the subclass's
    __init__ sets ``self.vision``, a module whose steps(pixel values [num_images, ...], chunk_rows)
    runs in units to [num_images, tokens_per_image, hidden] and whose load_weights takes the
    checkpoint's vision tensors under their full names. The encoder stays in the model's dtype: quantization applies
    to the language model's linears only."""

    vision: torch.nn.Module

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                image_embeds: EmbeddingRows | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, image_embeds)

    def encode_steps(self, image: Any, chunk_rows: int | None) -> Generator[float, None, torch.Tensor]:
        """One image's pixel values (multimodal/image_processor.py) -> its embeddings
        [tokens_per_image, hidden], in units (models/encoder_steps.py)."""
        dtype = next(self.vision.parameters()).dtype
        embeddings = yield from self.vision.steps(torch.from_numpy(image)[None].to(dtype), chunk_rows)
        return embeddings[0]

    def checkpoint_parameters(self) -> list[str]:
        return [name for name in super().checkpoint_parameters() if not name.startswith("vision.")]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     on_loaded: Callable[[str, Hashable], None] | None = None) -> None:
        """The language model's tensors through its own loading; the encoder's (a few hundred MB
        at most, held until the stream ends) then into the encoder."""
        vision: list[tuple[str, torch.Tensor]] = []

        def language() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(VISION_PREFIXES):
                    vision.append((name, tensor))
                else:
                    yield language_model_name(name), tensor

        super().load_weights(language(), on_loaded)
        self.vision.load_weights(vision)
