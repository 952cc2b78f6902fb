"""Bidirectional encoders (BERT, XLM-RoBERTa as bge-m3 uses it, ModernBERT, and their sequence
classifiers, the cross-encoder rerankers): what of config.json their code reads, normalised once."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dabba.arch.rope_scaling import LAYER_TYPES

# architecture -> (family, its classification head: None for the bare encoder)
ENCODER_ARCHITECTURES = {
    "BertModel": ("bert", None),
    "BertForSequenceClassification": ("bert", "bert"),
    "XLMRobertaModel": ("roberta", None),
    "XLMRobertaForSequenceClassification": ("roberta", "roberta"),
    "RobertaModel": ("roberta", None),
    "RobertaForSequenceClassification": ("roberta", "roberta"),
    "ModernBertModel": ("modernbert", None),
    "ModernBertForSequenceClassification": ("modernbert", "modernbert"),
}
ENCODER_ACTIVATIONS = ("gelu",)  # exact (erf) GELU, as BERT, XLM-R and ModernBERT use


@dataclass(frozen=True)
class EncoderConfig:
    """``family``: "bert" or "roberta" (RoBERTa's positions start after its padding index:
    ``position_offset``); ``classifier``: None (the encoder's hidden states are the output), "bert"
    (a dense + tanh pooler over the first token, then a linear classifier) or "roberta" (dense +
    tanh over the first token, then out_proj) or "modernbert" (dense, GELU, LayerNorm over the
    pooled state, the first token's or the mean: ``classifier_pooling``); ``num_labels``: the
    classifier's outputs. ModernBERT's alone: ``layer_windows`` (per layer, how far a token sees
    either way; None: the whole input), ``layer_rope_thetas`` (per layer), and which of its
    LayerNorms and linears carry biases."""

    family: str
    type_vocab_size: int
    layer_norm_eps: float
    position_offset: int
    classifier: str | None
    num_labels: int
    pad_token_id: int | None
    layer_windows: tuple[int | None, ...] = ()
    layer_rope_thetas: tuple[float, ...] = ()
    norm_bias: bool = True
    mlp_bias: bool = True
    classifier_bias: bool = True
    classifier_pooling: str = "cls"


def encoder_config(arch: str, cfg: dict[str, Any]) -> EncoderConfig:
    family, classifier = ENCODER_ARCHITECTURES[arch]
    if family == "modernbert":
        return _modernbert(arch, cfg, classifier)
    act = cfg.get("hidden_act", "gelu")
    if act not in ENCODER_ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {act!r} for {arch} (supported: {ENCODER_ACTIVATIONS})")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"unsupported position_embedding_type {cfg['position_embedding_type']!r} (absolute only)")
    pad = cfg.get("pad_token_id")
    offset = (pad + 1 if isinstance(pad, int) else 2) if family == "roberta" else 0
    num_labels = (cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 1) if classifier else 0
    return EncoderConfig(family, int(cfg.get("type_vocab_size", 2)), float(cfg.get("layer_norm_eps", 1e-12)),
                         offset, classifier, int(num_labels), pad)


def _modernbert(arch: str, cfg: dict[str, Any], classifier: str | None) -> EncoderConfig:
    """Both spellings transformers writes: layer_types and rope_parameters per layer type (5.x), or
    global_attn_every_n_layers and global_rope_theta / local_rope_theta (the released checkpoints)."""
    for key in ("hidden_activation", "classifier_activation"):
        if cfg.get(key, "gelu") not in ENCODER_ACTIVATIONS:
            raise ValueError(f"unsupported {key} {cfg[key]!r} for {arch} (supported: {ENCODER_ACTIVATIONS})")
    num_layers = cfg["num_hidden_layers"]
    every = cfg.get("global_attn_every_n_layers", 3)
    types = cfg.get("layer_types") or ["sliding_attention" if i % every else "full_attention"
                                       for i in range(num_layers)]
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"layer_types must name {num_layers} layers, each one of {LAYER_TYPES}")
    rope = cfg.get("rope_parameters") or {}
    defaults = {"full_attention": cfg.get("global_rope_theta", 160_000.0),
                "sliding_attention": cfg.get("local_rope_theta", 10_000.0)}
    thetas = {}
    for kind, default in defaults.items():
        params = rope.get(kind) or {}
        if params.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope_type {params['rope_type']!r} for {arch}'s {kind} (default only)")
        thetas[kind] = float(params.get("rope_theta", default))
    local = cfg.get("local_attention", 128)
    if not isinstance(local, int) or local < 2:
        raise ValueError(f"local_attention must be an integer >= 2, got {local!r}")
    pooling = cfg.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise ValueError(f"unsupported classifier_pooling {pooling!r} (cls or mean)")
    num_labels = (cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 1) if classifier else 0
    return EncoderConfig("modernbert", 1, float(cfg.get("norm_eps", 1e-5)), 0, classifier, int(num_labels),
                         cfg.get("pad_token_id"),
                         layer_windows=tuple(None if t == "full_attention" else local // 2 for t in types),
                         layer_rope_thetas=tuple(thetas[t] for t in types),
                         norm_bias=bool(cfg.get("norm_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
                         classifier_bias=bool(cfg.get("classifier_bias", False)), classifier_pooling=pooling)
