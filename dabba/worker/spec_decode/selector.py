"""The proposer of drafts the configuration asks for, chosen in one place."""
from __future__ import annotations

from typing import Any

import torch

from dabba.models.resolved_config import ResolvedConfig
from dabba.worker.spec_decode.draft_model import DraftModel
from dabba.worker.spec_decode.ngram import NgramProposer
from dabba.worker.spec_decode.proposer import Proposer


def make_proposer(resolved: ResolvedConfig, backend: Any, kv_quant: Any, generator: torch.Generator
                  ) -> Proposer | None:
    """The configured proposer (None: no speculative decoding). Under tensor parallelism each rank
    runs the whole proposer: the same drafts on each."""
    spec = resolved.config.scheduler_config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    return DraftModel(resolved, backend, kv_quant, generator)
