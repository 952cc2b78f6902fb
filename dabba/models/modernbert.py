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

from typing import Callable, Hashable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from dabba.arch.config import ArchConfig
from dabba.layers.encoder_attention import bidirectional_attention
from dabba.layers.linear import Linear
from dabba.layers.native_form import NoNativeForm
from dabba.quantization.config import QuantConfig


def _layer_norm(cfg: ArchConfig) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.encoder.layer_norm_eps, bias=cfg.encoder.norm_bias)


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE, rotate-half form, on [num_tokens, num_heads, head_dim] at ``positions``."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, dtype=torch.float32, device=x.device) / half)
    angles = positions.float()[:, None] * inv_freq  # [num_tokens, half]
    cos, sin = (torch.cat([f, f], dim=-1)[:, None, :] for f in (angles.cos(), angles.sin()))
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

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = (t.view(num_tokens, self.num_heads, self.head_dim)
                   for t in self.qkv(self.attn_norm(x)).chunk(3, dim=-1))
        q, k = _rotate(q, positions, self.theta), _rotate(k, positions, self.theta)
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
        for layer in self.layers:
            x = layer(x, positions)
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


# checkpoint name (past "model.") -> ours, and the shard a fused tensor fills (None: all of them)
_RENAMES = (("embeddings.tok_embeddings.", "model.tok_embeddings."), ("embeddings.norm.", "model.embedding_norm."),
            ("final_norm.", "model.final_norm."), ("head.dense.", "classifier.dense."),
            ("head.norm.", "classifier.norm."), ("classifier.", "classifier.out."))
_LAYER_RENAMES = ((".attn.Wqkv.", ".qkv."), (".attn.Wo.", ".attn_out."), (".mlp.Wi.", ".mlp_in."),
                  (".mlp.Wo.", ".mlp_out."))


class ModernBertModel(nn.Module):
    """Served as a pooler, or with its head as a scorer (``classify`` the pooled state)."""

    def __init__(self, cfg: ArchConfig, max_position: int, quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = ModernBertEncoder(cfg, quant_config)
        self.classifier = ModernBertHead(cfg) if cfg.encoder.classifier else None

    def native_layers(self) -> list:
        raise NoNativeForm("ModernBERT's layers run in Python (bidirectional attention, local windows)")

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
        """Copy checkpoint tensors in, under their Hugging Face names; fail loudly on unexpected or
        missing ones. The fused Wqkv and Wi fill every shard of their merged layers."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected = []
        for name, tensor in weights:
            target = self._target(name)
            if target is None:
                continue
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loader(param, tensor, None)
            elif param.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint tensor {tuple(tensor.shape)} != expected {tuple(param.shape)}")
            else:
                param.data.copy_(tensor)
            loaded.add(target)
            if on_loaded is not None:
                on_loaded(target, None)
        if unexpected:
            raise ValueError(f"checkpoint has unexpected tensors: {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}")
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {missing[:10]}{' ...' if len(missing) > 10 else ''}")

    def _target(self, name: str) -> str | None:
        """A checkpoint name's parameter (None: not read)."""
        name = name.removeprefix("model.")
        if name.startswith(("head.", "classifier.", "decoder.")) and self.classifier is None:
            return None  # a masked-LM or classification head on a checkpoint served for embeddings
        if name.startswith("layers."):
            for theirs, ours in _LAYER_RENAMES:
                name = name.replace(theirs, ours)
            return f"model.{name}"
        for theirs, ours in _RENAMES:
            if name.startswith(theirs):
                return ours + name.removeprefix(theirs)
        return name
