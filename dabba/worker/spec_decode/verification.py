"""Verifying drafts, whatever proposed them: a request's drafts run in the same forward as its next
token, each position giving a logits row.

- Row states (``row_states``): row j is sampled as a plain run would sample the request's next
  token had the drafts before it been its output (penalties, min_tokens and a seeded request's
  noise all see them).
- Rejection sampling (``rejection_sample``): a row that verifies a draft token d drawn from the
  draft's distribution q keeps d with probability min(1, p(d) / q(d)), else draws from
  norm(max(0, p - q)): the token that comes out is distributed as p, whatever q is (Leviathan et
  al. 2023, Chen et al. 2023); ``draft_rows`` marks those rows for the sampler. One-hot proposals
  (n-gram, a greedy request's draft-model argmax) need no q: comparing tokens is rejection
  sampling for them (draft d accepted with probability p(d), else a token drawn from p without d).
- Accepted tokens (``accepted_tokens``): the sampled tokens while each equals the draft it
  verifies, then the first that differs. A rejected row's token is never its draft, so decoding
  this way gives exactly what decoding one token a step gives.
"""
from __future__ import annotations

import dataclasses

import torch

from dabba.worker.random_draws import VERIFY_STREAM, race, row_noise
from dabba.worker.request_states import CachedRequestState
from dabba.worker.sampling_metadata import SamplingMetadata, reads_its_output


def row_states(states: dict[str, CachedRequestState], request_ids: list[str],
               drafts: list[list[int]]) -> list[CachedRequestState]:
    """A state per logits row: a request's own, then for the row after each of its drafts the
    request as if its output already ended with the drafts up to there."""
    rows = []
    for request_id, draft in zip(request_ids, drafts):
        state = states[request_id]
        rows.append(state)
        if reads_its_output(state):
            rows += [dataclasses.replace(state, token_ids=state.token_ids + draft[:j]) for j in range(1, len(draft) + 1)]
        else:  # nothing of its sampling depends on the position: the state itself serves every row
            rows += [state] * len(draft)
    return rows


def draft_rows(md: SamplingMetadata, states: dict[str, CachedRequestState], request_ids: list[str],
               first_rows: list[int], drafts: list[list[int]], device: torch.device) -> None:
    """Mark the rows verifying a draft model's sampled proposal for the sampler's rejection step:
    each row's draft token and q (greedy rows and n-gram proposals compare tokens instead)."""
    rows, tokens, probs = [], [], []
    for request_id, first, draft in zip(request_ids, first_rows, drafts):
        q = states[request_id].draft_probs
        if draft and q is not None:
            rows += range(first, first + len(draft))
            tokens += draft
            probs.append(q[:len(draft)])
    if rows:
        md.draft_rows = torch.tensor(rows, device=device)
        md.draft_token_ids = torch.tensor(tokens, device=device)
        md.draft_probs = torch.cat(probs)


def rejection_sample(p: torch.Tensor, md: SamplingMetadata, generator: torch.Generator) -> torch.Tensor:
    """The draft rows' tokens (p: their distributions, [len(md.draft_rows), vocab]): each row's
    draft token, or a draw from the residual."""
    q, d = md.draft_probs, md.draft_token_ids
    rows = md.draft_rows.tolist()
    draws = row_noise((len(rows), 1 + p.shape[1]), generator, [md.seeds[r] for r in rows],
                      [md.output_indices[r] for r in rows], VERIFY_STREAM, p.device)
    u, noise = draws[:, 0], draws[:, 1:]  # the acceptance test's, then the residual draw's
    p_d, q_d = p.gather(1, d[:, None])[:, 0], q.gather(1, d[:, None])[:, 0]
    accept = u * q_d < p_d
    residual = race((p - q).clamp_(min=0), noise)
    return torch.where(accept, d, residual)


def accepted_tokens(sampled: list[int], draft: list[int]) -> list[int]:
    """What a step gives a request: the sampled tokens while each equals the draft it verifies,
    then the first that differs (or the one after the last draft)."""
    tokens = []
    for j, token in enumerate(sampled):
        tokens.append(token)
        if j == len(draft) or token != draft[j]:
            break
    return tokens
