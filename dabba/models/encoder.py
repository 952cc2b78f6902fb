"""What the bidirectional encoder families (models/bert.py, models/modernbert.py) share: served as a
pooler (their hidden states pooled as the checkpoint says) or, with a classification head, as a
scorer (``classify`` the pooled state); never a generator; weights loaded under the Hugging Face
names, each family saying where a checkpoint name goes (``_target``)."""
from __future__ import annotations

from typing import Callable, Hashable, Iterable

import torch
from torch import nn

from dabba.arch.config import ArchConfig
from dabba.layers.native_form import NoNativeForm


class EncoderModel(nn.Module):
    """``model``: token ids and positions -> every token's last hidden state; ``classifier``: the
    pooled state -> ``num_labels`` logits, or None for an embedding model."""

    config: ArchConfig
    model: nn.Module
    classifier: nn.Module | None
    WHY_NO_NATIVE_FORM = "an encoder's layers run in Python (bidirectional attention)"

    def native_layers(self) -> list:
        raise NoNativeForm(self.WHY_NO_NATIVE_FORM)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an encoder has no LM head: it does not generate")

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[num_inputs, hidden] pooled states -> [num_inputs, num_labels] float32 logits."""
        assert self.classifier is not None, "classify() needs a sequence-classification checkpoint"
        return self.classifier(pooled).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     on_loaded: Callable[[str, Hashable], None] | None = None) -> None:
        """Copy checkpoint tensors in; fail loudly on unexpected or missing ones. A tensor with no
        shard id fills every shard of its parameter (a fused Wqkv)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected = []
        for name, tensor in weights:
            target, shard_id = self._target(name)
            if target is None:
                continue
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loader(param, tensor, shard_id)
            elif param.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint tensor {tuple(tensor.shape)} != expected {tuple(param.shape)}")
            else:
                param.data.copy_(tensor)
            loaded.update(f"{target}#{s}" for s in (self._shards(target) if shard_id is None else (shard_id,)))
            if on_loaded is not None:
                on_loaded(target, shard_id)
        if unexpected:
            raise ValueError(f"checkpoint has unexpected tensors: {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}")
        missing = sorted({f"{n}#{s}" for n in params for s in self._shards(n)} - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {missing[:10]}{' ...' if len(missing) > 10 else ''}")

    def _target(self, name: str) -> tuple[str | None, Hashable]:
        """A checkpoint name's parameter (None: not read) and shard id (None: the whole of it)."""
        raise NotImplementedError

    def _shards(self, param_name: str) -> tuple[Hashable, ...]:
        """The shards a parameter is loaded in (separate checkpoint tensors), (None,) if whole."""
        return (None,)
