"""Token embedding and the LM head (which may share the embedding's weight)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dabba import native
from dabba.quantization.base import LinearMethod
from dabba.quantization.rtn import Int8RTNMethod


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
        self.int8_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (codes, scales): see use_int8_rows

    def use_int8_rows(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Look rows up in a tied LM head's INT8 codes ([vocab, hidden], a scale per row) and drop
        the full-precision table: one copy of the vocabulary's weights, as llama.cpp keeps, not a
        bf16 table beside the quantized head (272 MiB on Qwen2.5-0.5B, 512 MiB on Llama-3.2-1B).
        A row comes back as codes * scale in the model's dtype, the head's own dequantization."""
        self.int8_rows = (codes, scales)
        self.weight = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.int8_rows is not None:
            codes, scales = self.int8_rows
            x = F.embedding(input_ids, codes).to(scales.dtype) * scales[input_ids, None]
        else:
            x = F.embedding(input_ids, self.weight)  # [num_tokens, hidden]
        if self.scale is None:
            return x
        return x * torch.tensor(self.scale, dtype=torch.float32, device=x.device).to(x.dtype)


class LMHead(nn.Module):
    """hidden -> logits. With a ``quant_method`` the head packs its weight once after loading; a
    tied embedding then looks its rows up in the head's INT8 codes where the head has them
    (shares_packed_rows), else keeps its full-precision table."""

    def __init__(self, vocab_size: int, hidden_size: int, quant_method: LinearMethod | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = vocab_size, hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.quant_method = quant_method
        self._tied: list[VocabEmbedding] = []  # a list, not a submodule: the embedding stays the model's

    def tie(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight
        self._tied = [embedding]

    @property
    def shares_packed_rows(self) -> bool:
        """Tied, and packed as INT8 rows with a scale each (load-time int8/int4's head)."""
        return bool(self._tied) and isinstance(self.quant_method, Int8RTNMethod)

    def packed(self) -> None:
        """Called once the quant method has packed the weight (the loader's LayerwiseRepacking)."""
        if self.shares_packed_rows:
            self._tied[0].use_int8_rows(self.qweight, self.scales)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # [num_rows, hidden] -> [num_rows, vocab]; only the rows that sample reach here.
        if self.quant_method is not None:
            return self.quant_method.apply(self, hidden, None)
        return native.linear(hidden, self.weight)
