"""BERT-style bidirectional encoders (BERT, XLM-RoBERTa as bge-m3 uses it, and their sequence
classifiers, the cross-encoder rerankers): what of config.json their code reads, normalised once."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# architecture -> (family, its classification head: None for the bare encoder)
ENCODER_ARCHITECTURES = {
    "BertModel": ("bert", None),
    "BertForSequenceClassification": ("bert", "bert"),
    "XLMRobertaModel": ("roberta", None),
    "XLMRobertaForSequenceClassification": ("roberta", "roberta"),
    "RobertaModel": ("roberta", None),
    "RobertaForSequenceClassification": ("roberta", "roberta"),
}
ENCODER_ACTIVATIONS = ("gelu",)  # exact (erf) GELU, as BERT and XLM-R use


@dataclass(frozen=True)
class EncoderConfig:
    """``family``: "bert" or "roberta" (RoBERTa's positions start after its padding index:
    ``position_offset``); ``classifier``: None (the encoder's hidden states are the output), "bert"
    (a dense + tanh pooler over the first token, then a linear classifier) or "roberta" (dense +
    tanh over the first token, then out_proj); ``num_labels``: the classifier's outputs."""

    family: str
    type_vocab_size: int
    layer_norm_eps: float
    position_offset: int
    classifier: str | None
    num_labels: int
    pad_token_id: int | None


def encoder_config(arch: str, cfg: dict[str, Any]) -> EncoderConfig:
    family, classifier = ENCODER_ARCHITECTURES[arch]
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
