"""The attention backend interface, the per-step metadata, and the forward context.

A backend is asked three things: the shape of one layer's KV-cache tensor, the metadata for a
step (built once, shared by every layer), and attention for one layer. Layers find the step's
metadata and their cache through ``forward_context``, a context manager over a ContextVar.
"""
from __future__ import annotations

import contextlib
import contextvars
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch


@dataclass
class CommonAttentionMetadata:
    """What every backend needs, per request ``i`` of the flat batch::

        tokens of request i in the batch:  query_start_loc[i] .. query_start_loc[i+1]
        its positions:                      seq_lens[i] - query_len[i] .. seq_lens[i]
        slot of flat token t in the cache:  slot_mapping[t] = block_id * block_size + offset

    Attention is causal (a query sees the keys up to its own position) unless ``key_ends`` says
    where each query's keys end (exclusive; at or past its position + 1, within its sequence):
    the image tokens of Gemma 3 see their whole image.
    """

    query_start_loc: np.ndarray  # [num_reqs + 1] int64, host
    seq_lens: np.ndarray  # [num_reqs] int64, host: context + this step's tokens
    block_table: np.ndarray  # [num_reqs, max_num_blocks] int64, host, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, device
    block_size: int
    device: torch.device
    key_ends: np.ndarray | None = None  # [num_tokens] int64, host; None: causal

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)


class AttentionBackend(ABC):
    @abstractmethod
    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        ...

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        ...

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        metadata: Any,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write this step's k/v into the cache, then attend over each request's context: all of it,
        or with ``sliding_window`` W only the W keys ending at each query's own position
        (positions p - W + 1 .. p; transformers' ``kv_idx > q_idx - sliding_window``). The window
        is the layer's; the metadata, built once per step (per KV-cache group), is shared by layers
        with and without. ``softcap``: scores -> softcap * tanh(scores / softcap) after the scale,
        before the mask (Gemma 2), or None."""


@dataclass
class ForwardContext:
    backend: AttentionBackend
    metadata: list[Any]  # one per KV-cache group: each group's layers read their own block tables
    kv_caches: list[torch.Tensor]  # one per layer
    layer_groups: Sequence[int] | None = None  # layer -> its group; None: one group
    token_type_ids: torch.Tensor | None = None  # [num_tokens]: an encoder's text pairs (1: the second text)

    def layer_metadata(self, layer_idx: int) -> Any:
        return self.metadata[0 if self.layer_groups is None else self.layer_groups[layer_idx]]


_forward_context: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("dabba_forward_context", default=None)


@contextlib.contextmanager
def forward_context(backend: AttentionBackend, metadata: list[Any], kv_caches: list[torch.Tensor],
                    layer_groups: Sequence[int] | None = None,
                    token_type_ids: torch.Tensor | None = None) -> Iterator[None]:
    token = _forward_context.set(ForwardContext(backend, metadata, kv_caches, layer_groups, token_type_ids))
    try:
        yield
    finally:
        _forward_context.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _forward_context.get()
    if ctx is None:
        raise RuntimeError("attention ran outside forward_context(): the model runner sets it per step")
    return ctx
