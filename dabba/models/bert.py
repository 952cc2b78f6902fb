"""BERT-style bidirectional encoders: BERT and XLM-RoBERTa (bge-m3, e5, bge-reranker), bare for
embeddings or with their sequence-classification heads (cross-encoder rerankers).

Post-norm layers: x = LN(x + attention(x)); x = LN(x + W2 gelu(W1 x)), every linear with a bias.
Each request's tokens attend to all of its own (layers/encoder_attention.py); no KV cache: an
input runs in one step, whole. Weights arrive under the Hugging Face names (with or without the
"bert." / "roberta." prefix); q/k/v are merged into one GEMM.
"""
from __future__ import annotations

from typing import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from dabba.arch.config import ArchConfig
from dabba.layers.encoder_attention import bidirectional_attention, current_token_type_ids
from dabba.layers.linear import Linear
from dabba.models.encoder import EncoderModel
from dabba.quantization.config import QuantConfig

QKV = {"attention.self.query": "q", "attention.self.key": "k", "attention.self.value": "v"}


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        enc = cfg.encoder
        self.position_offset = enc.position_offset
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings + enc.position_offset, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(enc.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=enc.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # [num_tokens]: 0, or 1 in a pair's second text; a model of one type (RoBERTa's) reads all as 0, as
        # its tokenizers write them
        types = current_token_type_ids(input_ids).clamp(max=self.token_type_embeddings.num_embeddings - 1)
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
             + self.token_type_embeddings(types))
        return self.LayerNorm(x)


class BertLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, prefix: str, quant_config: QuantConfig | None) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.encoder.layer_norm_eps
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.qkv = Linear(h, [h, h, h], bias=True, shard_ids=("q", "k", "v"), prefix=f"{prefix}.qkv",
                          quant_config=quant_config)
        self.attention_output = Linear(h, [h], bias=True, prefix=f"{prefix}.attention.output.dense",
                                       quant_config=quant_config)
        self.attention_norm = nn.LayerNorm(h, eps=eps)
        self.intermediate = Linear(h, [cfg.intermediate_size], bias=True, prefix=f"{prefix}.intermediate.dense",
                                   quant_config=quant_config)
        self.output = Linear(cfg.intermediate_size, [h], bias=True, prefix=f"{prefix}.output.dense",
                             quant_config=quant_config)
        self.output_norm = nn.LayerNorm(h, eps=eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = (t.view(num_tokens, self.num_heads, self.head_dim) for t in self.qkv(x).chunk(3, dim=-1))
        attended = bidirectional_attention(q, k, v, positions, self.head_dim ** -0.5)  # [num_tokens, hidden]
        x = self.attention_norm(x + self.attention_output(attended))
        return self.output_norm(x + self.output(F.gelu(self.intermediate(x))))


class BertEncoder(nn.Module):
    """The embeddings and the layers: every token's last hidden state ([num_tokens, hidden])."""

    def __init__(self, cfg: ArchConfig, quant_config: QuantConfig | None) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(BertLayer(cfg, f"encoder.layer.{i}", quant_config)
                                    for i in range(cfg.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids, positions)
        for layer in self.layers:
            x = layer(x, positions)
        return x


class SequenceClassifier(nn.Module):
    """The first token's hidden state -> ``num_labels`` logits: BERT's pooler (dense + tanh) then
    its classifier, or RoBERTa's head (dense + tanh, then out_proj)."""

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        h, enc = cfg.hidden_size, cfg.encoder
        self.dense = nn.Linear(h, h)
        self.out = nn.Linear(h, enc.num_labels)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.dense(first)))


class BertModel(EncoderModel):
    """BERT, RoBERTa, XLM-RoBERTa: bare, or with their classification heads."""

    WHY_NO_NATIVE_FORM = "a BERT-style encoder's layers run in Python (post-norm LayerNorms, bidirectional attention)"

    def __init__(self, cfg: ArchConfig, max_position: int, quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = BertEncoder(cfg, quant_config)
        self.classifier = SequenceClassifier(cfg) if cfg.encoder.classifier else None

    def _shards(self, param_name: str) -> tuple[Hashable, ...]:
        return ("q", "k", "v") if ".qkv." in param_name else (None,)

    def _target(self, name: str) -> tuple[str | None, Hashable]:
        """A BERT pooler read only before a classifier; q, k and v into the merged qkv, by shard."""
        for prefix in ("bert.", "roberta."):
            name = name.removeprefix(prefix)
        if name.startswith(("pooler.", "cls.", "lm_head.")) and self.classifier is None:
            return None, None  # BERT's next-sentence pooler, a masked-LM head: not an embedding's
        if name.endswith("position_ids") or name.endswith("token_type_ids"):
            return None, None  # buffers some checkpoints carry
        if name.startswith("classifier."):  # RoBERTa's head (dense, out_proj), or BERT's classifier after its pooler
            rest = name.removeprefix("classifier.")
            if rest.startswith("dense."):
                return name, None
            return f"classifier.out.{rest.removeprefix('out_proj.')}", None
        if self.classifier is not None and name.startswith("pooler.dense."):  # BERT's: pooler, then classifier
            return name.replace("pooler.dense.", "classifier.dense."), None
        if name.startswith("embeddings."):
            return f"model.{name}", None
        if name.startswith("encoder.layer."):
            for fragment, sid in QKV.items():
                if f".{fragment}." in name:
                    return f"model.{name.replace(fragment, 'qkv').replace('encoder.layer.', 'layers.')}", sid
            renamed = (name.replace("encoder.layer.", "layers.").replace(".attention.output.LayerNorm.",
                                                                         ".attention_norm.")
                       .replace(".attention.output.dense.", ".attention_output.")
                       .replace(".intermediate.dense.", ".intermediate.").replace(".output.LayerNorm.", ".output_norm.")
                       .replace(".output.dense.", ".output."))
            return f"model.{renamed}", None
        return name, None
