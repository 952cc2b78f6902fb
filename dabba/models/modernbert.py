"""ModernBERT (gte-modernbert, modernbert-embed, gte-reranker-modernbert): a bidirectional encoder
of another build than BERT's, bare for embeddings or with its sequence-classification head.

Pre-norm layers without biases: x += Wo attention(LN(x)) (the first layer's LN is the identity,
the embedding's own LN standing in), x += W2 (gelu(a) * g) with [a; g] = Wi LN(x); a final LN.
Rotary positions, no position table. Every third layer (global_attn_every_n_layers) attends to
the whole input with RoPE base global_rope_theta; the others only to tokens within
local_attention / 2 of their own, with base local_rope_theta. As BERT's (models/bert.py), an
input runs in one step, whole, with no KV cache.
"""
from __future__ import annotations

from typing import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from dabba.arch.config import ArchConfig
from dabba.layers.encoder_attention import bidirectional_attention
from dabba.layers.linear import Linear
from dabba.models.encoder import EncoderModel
from dabba.quantization.config import QuantConfig


def _layer_norm(cfg: ArchConfig) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.encoder.layer_norm_eps, bias=cfg.encoder.norm_bias)


def _cos_sin(positions: torch.Tensor, theta: float, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin at ``positions`` ([num_tokens, 1, head_dim] each, float32): once per
    step and base, shared by the layers of that base."""
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, dtype=torch.float32, device=positions.device) / half)
    angles = positions.float()[:, None] * inv_freq  # [num_tokens, half]
    return tuple(torch.cat([f, f], dim=-1)[:, None, :] for f in (angles.cos(), angles.sin()))  # type: ignore[return-value]


def _rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE, rotate-half form, on [num_tokens, num_heads, head_dim]."""
    cos, sin = cos_sin
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class ModernBertLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, index: int, quant_config: QuantConfig | None) -> None:
        super().__init__()
        h, enc, prefix = cfg.hidden_size, cfg.encoder, f"layers.{index}"
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.window = enc.layer_windows[index]  # None: the whole input
        self.theta = enc.layer_rope_thetas[index]
        self.attn_norm = _layer_norm(cfg) if index > 0 else nn.Identity()
        self.qkv = Linear(h, [h, h, h], bias=cfg.qkv_bias, shard_ids=("q", "k", "v"), prefix=f"{prefix}.attn.Wqkv",
                          quant_config=quant_config)
        self.attn_out = Linear(h, [h], bias=cfg.o_bias, prefix=f"{prefix}.attn.Wo", quant_config=quant_config)
        self.mlp_norm = _layer_norm(cfg)
        i = cfg.intermediate_size
        self.mlp_in = Linear(h, [i, i], bias=enc.mlp_bias, shard_ids=("input", "gate"), prefix=f"{prefix}.mlp.Wi",
                             quant_config=quant_config)
        self.mlp_out = Linear(i, [h], bias=enc.mlp_bias, prefix=f"{prefix}.mlp.Wo", quant_config=quant_config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                rope: dict[float, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """``rope``: each RoPE base's cos and sin at ``positions`` (_cos_sin)."""
        num_tokens = x.shape[0]
        q, k, v = (t.view(num_tokens, self.num_heads, self.head_dim)
                   for t in self.qkv(self.attn_norm(x)).chunk(3, dim=-1))
        q, k = _rotate(q, rope[self.theta]), _rotate(k, rope[self.theta])
        x = x + self.attn_out(bidirectional_attention(q, k, v, positions, self.head_dim ** -0.5, self.window))
        a, gate = self.mlp_in(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.mlp_out(F.gelu(a) * gate)


class ModernBertEncoder(nn.Module):
    def __init__(self, cfg: ArchConfig, quant_config: QuantConfig | None) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embedding_norm = _layer_norm(cfg)
        self.layers = nn.ModuleList(ModernBertLayer(cfg, i, quant_config) for i in range(cfg.num_hidden_layers))
        self.final_norm = _layer_norm(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embedding_norm(self.tok_embeddings(input_ids))
        head_dim = self.layers[0].head_dim
        rope = {theta: _cos_sin(positions, theta, head_dim) for theta in {layer.theta for layer in self.layers}}
        for layer in self.layers:
            x = layer(x, positions, rope)
        return self.final_norm(x)


class ModernBertHead(nn.Module):
    """The pooled state (the first token's, or the mean: classifier_pooling) -> ``num_labels``
    logits: dense, GELU, LayerNorm, then the classifier."""

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        h, enc = cfg.hidden_size, cfg.encoder
        self.dense = nn.Linear(h, h, bias=enc.classifier_bias)
        self.norm = _layer_norm(cfg)
        self.out = nn.Linear(h, enc.num_labels)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(F.gelu(self.dense(pooled))))


# checkpoint name (past "model.") -> ours
_RENAMES = (("embeddings.tok_embeddings.", "model.tok_embeddings."), ("embeddings.norm.", "model.embedding_norm."),
            ("final_norm.", "model.final_norm."), ("head.dense.", "classifier.dense."),
            ("head.norm.", "classifier.norm."), ("classifier.", "classifier.out."))
_LAYER_RENAMES = ((".attn.Wqkv.", ".qkv."), (".attn.Wo.", ".attn_out."), (".mlp.Wi.", ".mlp_in."),
                  (".mlp.Wo.", ".mlp_out."))


class ModernBertModel(EncoderModel):
    """Bare, or with its classification head."""

    WHY_NO_NATIVE_FORM = "ModernBERT's layers run in Python (bidirectional attention, local windows)"

    def __init__(self, cfg: ArchConfig, max_position: int, quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = ModernBertEncoder(cfg, quant_config)
        self.classifier = ModernBertHead(cfg) if cfg.encoder.classifier else None

    def _target(self, name: str) -> tuple[str | None, Hashable]:
        """A head read only on a classifier; the fused Wqkv and Wi whole (they fill every shard)."""
        name = name.removeprefix("model.")
        if name.startswith(("head.", "classifier.", "decoder.")) and self.classifier is None:
            return None, None  # a masked-LM or classification head on a checkpoint served for embeddings
        if name.startswith("layers."):
            for theirs, ours in _LAYER_RENAMES:
                name = name.replace(theirs, ours)
            return f"model.{name}", None
        for theirs, ours in _RENAMES:
            if name.startswith(theirs):
                return ours + name.removeprefix(theirs), None
        return name, None
