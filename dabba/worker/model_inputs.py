"""The flat batch a step runs: every scheduled token of every request in one row of tokens, where
each request's tokens sit in it, and the model's inputs built from it (worker/request_states.py
builds them each step)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dabba.attention.backend import CommonAttentionMetadata
from dabba.layers.embedding import EmbeddingRows


@dataclass(frozen=True)
class PoolingChunk:
    """A pooling request's rows in a step: its input from ``first_position`` on, ``finishes`` when
    they reach the input's end (its embedding is then ready)."""

    request_id: str
    rows: slice  # in the step's flat batch
    first_position: int
    finishes: bool


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens] (RoPE's; the attention metadata's are the flat batch's), or
    # [3, num_tokens] where an M-RoPE model's step holds images (worker/mrope_positions.py)
    attn: list[CommonAttentionMetadata]  # one per KV-cache group: the same requests, that group's tables
    logits_indices: torch.Tensor  # [rows]: the last scheduled token of each request that samples,
    # preceded by its last known token and all but the last of its drafts where it has drafts
    sampling_req_ids: list[str]  # requests that sample this step, in logits_indices order
    num_rows: list[int]  # logits rows of each of them: 1, or 1 + its drafts
    pooling: list[PoolingChunk] = field(default_factory=list)  # pooling requests' rows (they never sample)
    token_type_ids: torch.Tensor | None = None  # [num_tokens]: a cross-encoder's text pairs, else None
    image_embeds: EmbeddingRows | None = None  # the step's image tokens' embeddings, else None


@dataclass
class FlatBatch:
    """Where each request's tokens sit in a flat batch::

        request i's tokens:  query_start_loc[i] .. query_start_loc[i+1]
        at positions         num_computed[i] .. seq_lens[i] - 1
    """

    query_start_loc: np.ndarray  # [num_reqs + 1]
    seq_lens: np.ndarray  # [num_reqs]
    req_of_token: np.ndarray  # [num_tokens]
    positions: np.ndarray  # [num_tokens]

    @classmethod
    def of(cls, num_computed: np.ndarray, num_new: np.ndarray) -> "FlatBatch":
        query_start_loc = np.zeros(len(num_new) + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start_loc[1:])
        req_of_token = np.repeat(np.arange(len(num_new)), num_new)
        # each token's position: its request's num_computed + its offset within the request's tokens
        positions = np.arange(int(query_start_loc[-1])) - query_start_loc[req_of_token] + num_computed[req_of_token]
        return cls(query_start_loc, num_computed + num_new, req_of_token, positions)

    def metadata(self, block_table: np.ndarray, block_size: int, device: torch.device,
                 key_ends: np.ndarray | None = None) -> CommonAttentionMetadata:
        """The batch's attention metadata over one KV-cache group's tables ([num_reqs, blocks]);
        ``key_ends``: where each token's keys end, where not causal (CommonAttentionMetadata)."""
        positions = self.positions
        slot_mapping = block_table[self.req_of_token, positions // block_size] * block_size + positions % block_size
        return CommonAttentionMetadata(query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
                                       block_table=block_table, slot_mapping=torch.from_numpy(slot_mapping).to(device),
                                       block_size=block_size, device=device, key_ends=key_ends)
