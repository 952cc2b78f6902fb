"""Token embedding and the LM head (which may share the embedding's weight)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dabba import native
from dabba.quantization.base import LinearMethod


class VocabEmbedding(nn.Module):
    """Token ids -> rows of the weight, times ``scale`` where the family scales them (Gemma:
    sqrt(hidden_size)). The scale is rounded to the weight's dtype first, as transformers' Gemma
    does (its normaliser is a float32 tensor cast to the model dtype: sqrt(2304) = 48.0 becomes 48,
    sqrt(1152) = 33.94 becomes 34.0 in bfloat16); kept as a float, not a buffer, so it is not
    counted as a weight."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(input_ids, self.weight)  # [num_tokens, hidden]
        if self.scale is None:
            return x
        return x * torch.tensor(self.scale, dtype=torch.float32, device=x.device).to(x.dtype)


class LMHead(nn.Module):
    """hidden -> logits. With a ``quant_method`` the head keeps its own packed copy of the weight
    (made once after loading), so a tied embedding still looks rows up at full precision."""

    def __init__(self, vocab_size: int, hidden_size: int, quant_method: LinearMethod | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = vocab_size, hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.quant_method = quant_method

    def tie(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # [num_rows, hidden] -> [num_rows, vocab]; only the rows that sample reach here.
        if self.quant_method is not None:
            return self.quant_method.apply(self, hidden, None)
        return native.linear(hidden, self.weight)
