"""Turn the last-token logits of every sampling request into token ids: one call per step."""
from __future__ import annotations

import torch

from dabba.sampling_params import SamplingParams

_MASK64 = (1 << 63) - 1


def step_seed(seed: int, output_index: int) -> int:
    """Seed for one sampled position: the k-th token of a seeded request depends only on
    (seed, k), not on the batch or on preemption."""
    return (seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + 1) & _MASK64


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]) -> torch.Tensor:
        # logits: [num_reqs, vocab] float32 -> [num_reqs] int64
        greedy_ids = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy_ids
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=logits.device)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, one noise row per request.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, p in enumerate(params):
            if p.seed is not None and not p.greedy:
                gen = torch.Generator(device=logits.device).manual_seed(step_seed(p.seed, output_indices[i]))
                noise[i].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        return torch.where(is_greedy, greedy_ids, sampled)
