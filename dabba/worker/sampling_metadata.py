"""Per-step sampling tensors, built from the requests that sample this step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dabba.worker.request_states import CachedRequestState


@dataclass
class SamplingMetadata:
    """Per-row settings of the requests sampling this step ([num_reqs] unless noted)."""

    temperature: torch.Tensor  # 0 for greedy rows
    top_k: torch.Tensor | None  # int64; vocab size where disabled; None if no row uses it
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    presence_penalty: torch.Tensor | None  # these four are None unless some row uses penalties
    frequency_penalty: torch.Tensor | None
    repetition_penalty: torch.Tensor | None
    output_counts: torch.Tensor | None  # [num_reqs, vocab] float: occurrences in the output so far
    prompt_mask: torch.Tensor | None  # [num_reqs, vocab] bool: token occurs in the prompt
    bias_index: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) for logit_bias
    bias_value: torch.Tensor | None
    banned_index: tuple[torch.Tensor, torch.Tensor] | None  # stop tokens banned before min_tokens
    seeds: list[int | None]
    output_indices: list[int]  # how many tokens each request has generated so far
    num_logprobs: list[int | None]  # top-N per row, None = no logprobs
    # Rows verifying a draft model's sampled proposal: the rows, their draft tokens, and q, the
    # distribution each was drawn from ([len(draft_rows), vocab]); None when no row has one.
    draft_rows: torch.Tensor | None = None
    draft_token_ids: torch.Tensor | None = None
    draft_probs: torch.Tensor | None = None

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())


def _pairs(rows_and_ids: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows, ids = zip(*rows_and_ids)
    return torch.tensor(rows, device=device), torch.tensor(ids, device=device)


def reads_its_output(state: CachedRequestState) -> bool:
    """Whether a row's sampling depends on the request's output so far, as build_sampling_metadata
    reads it: penalties (counts of output tokens), the stop-token ban before min_tokens, and a
    seeded sample's noise (keyed on the output index). Speculative decoding's draft rows need
    their own state only then."""
    p = state.sampling_params
    return p.uses_penalties or state.num_output_tokens < p.min_tokens or (p.seed is not None and not p.greedy)


def build_sampling_metadata(states: list[CachedRequestState], vocab_size: int, device: torch.device) -> SamplingMetadata:
    params = [s.sampling_params for s in states]
    sampling = [not p.greedy for p in params]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    top_k = top_p = min_p = None
    if any(s and p.top_k > 0 for s, p in zip(sampling, params)):
        top_k = torch.tensor([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params], device=device)
    if any(s and p.top_p < 1 for s, p in zip(sampling, params)):
        top_p = column([p.top_p for p in params])
    if any(s and p.min_p > 0 for s, p in zip(sampling, params)):
        min_p = column([p.min_p for p in params])

    presence = frequency = repetition = counts = prompt_mask = None
    if any(p.uses_penalties for p in params):
        presence = column([p.presence_penalty for p in params])
        frequency = column([p.frequency_penalty for p in params])
        repetition = column([p.repetition_penalty for p in params])
        counts = torch.zeros(len(states), vocab_size, device=device)
        prompt_mask = torch.zeros(len(states), vocab_size, dtype=torch.bool, device=device)
        out_rows = [i for i, s in enumerate(states) for _ in range(s.num_output_tokens)]
        if out_rows:
            out_ids = [t for s in states for t in s.token_ids[s.num_prompt_tokens:]]
            counts.index_put_((torch.tensor(out_rows, device=device), torch.tensor(out_ids, device=device)),
                              torch.ones(len(out_ids), device=device), accumulate=True)
        prompt_mask[_pairs([(i, t) for i, s in enumerate(states) for t in s.token_ids[:s.num_prompt_tokens]], device)] = True

    bias_index = bias_value = None
    biases = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
    if biases:
        bias_index = _pairs([(i, t) for i, t, _ in biases], device)
        bias_value = column([b for _, _, b in biases])

    # Before min_tokens, the tokens that would stop the request cannot be sampled; under
    # structured_outputs the grammar decides where they may come (the two could leave no token).
    banned = [(i, t) for i, (s, p) in enumerate(zip(states, params))
              if s.num_output_tokens < p.min_tokens and p.structured_outputs is None
              for t in sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(s.eos_token_ids)))]

    return SamplingMetadata(
        temperature=column([p.temperature for p in params]),
        top_k=top_k, top_p=top_p, min_p=min_p,
        presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
        output_counts=counts, prompt_mask=prompt_mask,
        bias_index=bias_index, bias_value=bias_value,
        banned_index=_pairs(banned, device) if banned else None,
        seeds=[p.seed if not p.greedy else None for p in params],
        output_indices=[s.num_output_tokens for s in states],
        num_logprobs=[p.logprobs for p in params],
    )
