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
        super().load_weights(_base_model_tensors(weights, self.config), on_loaded)  # type: ignore[misc]


def _base_model_tensors(weights: Iterable[tuple[str, torch.Tensor]],
                        cfg: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's tensors under their ``model.`` names, and the score head; a causal LM
    read as a classifier (classifier_from_token) has its head made from the LM head's rows (the
    embedding's, where they are tied)."""
    source = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    for name, tensor in weights:
        if name.startswith("lm_head.") and name != source:
            continue
        name = name if name.startswith(("model.", "score.", "lm_head.")) else f"model.{name}"
        if cfg.classifier_token_ids and name == source:
            yield "score.weight", _score_from_tokens(tensor, cfg.classifier_token_ids, name)
        if name != "lm_head.weight":
            yield name, tensor


def _score_from_tokens(lm_head: torch.Tensor, token_ids: tuple[int, ...], name: str) -> torch.Tensor:
    """One token: its row (its logit); two, [a, b]: b's row minus a's (b's logit minus a's, whose
    sigmoid is b's two-way softmax probability: vLLM's from_2_way_softmax)."""
    if lm_head.dim() != 2 or max(token_ids) >= lm_head.shape[0]:
        raise ValueError(f"classifier_from_token: token ids {list(token_ids)} are not rows of {name} "
                         f"{tuple(lm_head.shape)}")
    rows = lm_head[list(token_ids)].float()
    return (rows[1] - rows[0] if len(token_ids) == 2 else rows[0]).unsqueeze(0)


@functools.cache
def pooling_variant(causal_lm: type[nn.Module]) -> Any:
    """``causal_lm``'s layers as a pooler (one class per family, made once)."""
    return type(f"{causal_lm.__name__}AsPooler", (PoolingModelMixin, causal_lm), {})
