"""Token embedding and the LM head (which may share the embedding's weight).

Under tensor parallelism both are vocabulary-parallel: rank r holds rows r * n .. (r + 1) * n of
the vocabulary (n = ceil(vocab / size), the last rank's tail zero-padded). The embedding looks up
the ids in its range, zeros the others and sums over the group; the LM head computes its part of
the logits, and the group gathers them in rank order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dabba.distributed.tensor_parallel import TensorParallel, current_tensor_parallel
from dabba.ops import native
from dabba.quantization.base import LinearMethod
from dabba.quantization.gguf import GGUFBlocks, GGUFLinearMethod, dequantize_rows


@dataclass(frozen=True)
class EmbeddingRows:
    """Rows that take the place of the token embeddings at ``indices`` of a step's flat batch: an
    image's embeddings over its placeholder tokens (after the embedding's scale, which they skip)."""

    indices: torch.Tensor  # [n] int64
    rows: torch.Tensor  # [n, hidden]

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        x[self.indices] = self.rows.to(x.dtype)
        return x


class VocabShard:
    """This rank's rows of a vocabulary-parallel table: ``start`` .. ``start + num_rows`` (padded),
    of which ``num_valid`` hold a token."""

    def __init__(self, vocab_size: int) -> None:
        self.tp: TensorParallel = current_tensor_parallel()
        self.vocab_size = vocab_size
        self.num_rows = math.ceil(vocab_size / self.tp.size)
        self.start = self.tp.rank * self.num_rows
        self.num_valid = max(0, min(self.num_rows, vocab_size - self.start))

    def make_weight(self, hidden_size: int) -> nn.Parameter:
        weight = nn.Parameter(torch.empty(self.num_rows, hidden_size), requires_grad=False)
        weight.weight_loader = self.load_rows
        return weight

    def load_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(f"checkpoint tensor {tuple(loaded.shape)} != expected {(self.vocab_size, param.shape[1])}")
        param.data[:self.num_valid].copy_(loaded[self.start:self.start + self.num_valid])
        param.data[self.num_valid:].zero_()

    def blocks(self, loaded: GGUFBlocks, hidden_size: int) -> GGUFBlocks:
        """This rank's rows of a table held as GGUF blocks, copied out of the file; padding rows are
        zero bytes, which every type reads as zeros."""
        if (loaded.rows, loaded.columns) != (self.vocab_size, hidden_size):
            raise ValueError(f"checkpoint tensor {(loaded.rows, loaded.columns)} != expected "
                             f"{(self.vocab_size, hidden_size)}")
        data = torch.zeros(self.num_rows, loaded.data.shape[1], dtype=torch.uint8)
        data[:self.num_valid] = loaded.data[self.start:self.start + self.num_valid]
        return GGUFBlocks(loaded.type_name, data, hidden_size)


class VocabEmbedding(nn.Module):
    """Token ids -> rows of the weight, times ``scale`` where the family scales them (Gemma:
    sqrt(hidden_size)). The scale is rounded to the weight's dtype first, as transformers' Gemma
    does (its normaliser is a float32 tensor cast to the model dtype: sqrt(2304) = 48.0 becomes 48,
    sqrt(1152) = 33.94 becomes 34.0 in bfloat16); kept as a float, not a buffer, so it is not
    counted as a weight."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None) -> None:
        super().__init__()
        self.shard = VocabShard(vocab_size)
        self.weight = self.shard.make_weight(hidden_size)
        self.weight.weight_loader = self.load_rows
        self.dtype = self.weight.dtype  # the model's, also once the table is held otherwise
        self.scale = scale
        self.packed_rows: Callable[[torch.Tensor], torch.Tensor] | None = None  # see use_packed_rows
        self.gguf_rows: GGUFBlocks | None = None  # the table as a GGUF file's blocks: see load_rows

    def load_rows(self, param: nn.Parameter, loaded: torch.Tensor | GGUFBlocks, shard_id=None) -> None:
        """A GGUF file's quantized table stays in its blocks; a row is dequantized as it is looked up."""
        if isinstance(loaded, GGUFBlocks):
            self.gguf_rows = self.shard.blocks(loaded, param.shape[1])
            self.weight = None
            return
        self.shard.load_rows(param, loaded, shard_id)

    def use_packed_rows(self, lookup: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Look rows up in a tied LM head's packed weight (``lookup``: ids [T] -> rows [T, hidden]
        in the model's dtype, as the head dequantizes them) and drop the full-precision table: one
        copy of the vocabulary's weights, as llama.cpp keeps, not a bf16 table beside the quantized
        head (272 MiB on Qwen2.5-0.5B, 512 MiB on Llama-3.2-1B)."""
        self.packed_rows = lookup
        self.weight = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        shard = self.shard
        if shard.tp.size > 1:
            local = input_ids - shard.start
            outside = (local < 0) | (local >= shard.num_valid)
            x = self._rows(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0)
            x = shard.tp.all_reduce(x)  # each token's row from the rank that holds it
        else:
            x = self._rows(input_ids)  # [num_tokens, hidden]
        if self.scale is None:
            return x
        return x * torch.tensor(self.scale, dtype=torch.float32, device=x.device).to(x.dtype)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.gguf_rows is not None:
            rows = self.gguf_rows
            return dequantize_rows(rows.type_name, rows.data[ids], rows.columns, self.dtype)
        if self.packed_rows is not None:
            return self.packed_rows(ids.reshape(-1)).view(*ids.shape, -1)
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    """hidden -> logits. With a ``quant_method`` the head packs its weight once after loading; a
    tied embedding then looks its rows up in the head's packed weight where the method keeps rows
    it can read (shares_packed_rows), else keeps its full-precision table."""

    prefix = "lm_head"  # what a quant method names the layer by
    parallel = "column"  # each rank holds whole rows (output channels): its inputs are whole

    def __init__(self, vocab_size: int, hidden_size: int, quant_method: LinearMethod | None = None) -> None:
        super().__init__()
        self.shard = VocabShard(vocab_size)
        self.out_features, self.in_features = self.shard.num_rows, hidden_size  # this rank's rows
        self.weight = self.shard.make_weight(hidden_size)
        self.weight.weight_loader = self.load_rows
        self.output_sizes = [self.out_features]
        self.quant_method = quant_method
        self._tied: list[VocabEmbedding] = []  # a list, not a submodule: the embedding stays the model's

    def tie(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight
        self._tied = [embedding]
        if isinstance(self.quant_method, GGUFLinearMethod):  # the shared table arrives as the head's blocks
            self.weight.weight_loader = self.load_rows

    def load_rows(self, param: nn.Parameter, loaded: torch.Tensor | GGUFBlocks, shard_id=None) -> None:
        """A GGUF file's quantized head (or tied table) is the GGUF method's one segment."""
        if isinstance(loaded, GGUFBlocks):
            if not isinstance(self.quant_method, GGUFLinearMethod):
                raise ValueError("lm_head: GGUF blocks arrived for a head that does not read them")
            self.gguf_shards = {0: self.shard.blocks(loaded, self.in_features)}
            return
        self.shard.load_rows(param, loaded, shard_id)

    @property
    def shares_packed_rows(self) -> bool:
        """Tied, and packed as rows the embedding can read (the method's packs_embedding_rows:
        load-time INT8/INT4's and W8A8's INT8 head, a GGUF file's blocks)."""
        return bool(self._tied) and self.quant_method is not None and self.quant_method.packs_embedding_rows

    def packed(self) -> None:
        """Called once the quant method has packed the weight (the loader's LayerwiseRepacking)."""
        if self.shares_packed_rows:
            self._tied[0].use_packed_rows(self.quant_method.embedding_rows(self, self._tied[0].dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # [num_rows, hidden] -> [num_rows, vocab]; only the rows that sample reach here.
        if self.quant_method is not None:
            logits = self.quant_method.apply(self, hidden, None)
        else:
            logits = native.linear(hidden, self.weight)
        if self.shard.tp.size == 1:
            return logits
        return self.shard.tp.all_gather(logits)[:, :self.shard.vocab_size]
