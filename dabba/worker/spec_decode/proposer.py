"""The one interface the model runner proposes drafts through, whatever proposes them (ngram.py:
a lookup in the request's own tokens; draft_model.py: a small model on its own KV cache;
selector.py picks one)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from dabba.core.kv_cache_groups import KVCacheGroup
    from dabba.core.outputs import SchedulerOutput
    from dabba.worker.request_states import RequestStates


@dataclass
class Proposal:
    token_ids: list[int]
    probs: "torch.Tensor | None" = None  # [len(token_ids), vocab]: q of each token (a sampled draw); None: one-hot


class Proposer(Protocol):
    num_tokens: int  # the most tokens proposed for one request

    def bytes_per_block(self, block_size: int, kv_cache_dtype: str, groups: "tuple[KVCacheGroup, ...]") -> int:
        """What the proposer keeps per block of the target's pool (its own KV; 0 for none)."""
        ...

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        ...

    def propose(self, requests: "RequestStates", sched: "SchedulerOutput", sampled: list[str],
                wants: dict[str, int]) -> dict[str, Proposal]:
        """Called after every step (``sampled``: the requests that sampled a token; ``wants``: how
        many tokens each of those may be proposed): the drafts for their next step."""
        ...
