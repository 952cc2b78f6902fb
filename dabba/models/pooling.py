"""A decoder family served as a pooler (``runner="pooling"``: embedding checkpoints such as
Qwen3-Embedding and gte-Qwen2, or any family's base ``*Model``): the same layers without the LM
head. Such checkpoints store the base model's tensors, with or without the ``model.`` prefix
(transformers' ``Qwen3Model`` saves ``layers.0...``), and an LM head, if any, is not read."""
from __future__ import annotations

import functools
from typing import Any, Callable, Hashable, Iterable, Iterator

import torch
from torch import nn

from dabba.arch.config import ArchConfig
from dabba.quantization.config import QuantConfig


class PoolingModelMixin:
    """Put before a family's ForCausalLM class (pooling_variant): its model, no head."""

    model_cls: type[nn.Module]
    layer_cls: type[nn.Module]

    def __init__(self, cfg: ArchConfig, max_position: int, quant_config: QuantConfig | None = None) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.model = self.model_cls(cfg, max_position, self.layer_cls, quant_config)
        # a sequence classifier's head over the last token (Qwen3-Reranker's seq-cls form: one logit)
        self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False) if cfg.num_labels else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a model served as a pooler has no LM head: it does not generate")

    def classify(self, last: torch.Tensor) -> torch.Tensor:
        """[num_inputs, hidden] last-token states -> [num_inputs, num_labels] float32 logits."""
        assert self.score is not None, "classify() needs a sequence-classification checkpoint"
        return self.score(last).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     on_loaded: Callable[[str, Hashable], None] | None = None) -> None:
        super().load_weights(_base_model_tensors(weights), on_loaded)  # type: ignore[misc]


def _base_model_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.startswith("lm_head."):
            continue
        yield (name if name.startswith(("model.", "score.")) else f"model.{name}"), tensor


@functools.cache
def pooling_variant(causal_lm: type[nn.Module]) -> Any:
    """``causal_lm``'s layers as a pooler (one class per family, made once)."""
    return type(f"{causal_lm.__name__}AsPooler", (PoolingModelMixin, causal_lm), {})
