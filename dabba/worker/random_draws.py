"""The per-request noise every draw of a step takes: a token's sample, a draft model's proposals
and their verification, each on a stream of its own, so that a seeded request's k-th token
depends only on (seed, k), whatever the batch, preemption or speculation did."""
from __future__ import annotations

import torch

_MASK64 = (1 << 63) - 1


def step_seed(seed: int, output_index: int, stream: int = 0) -> int:
    """Seed for one sampled position: the k-th token of a seeded request depends only on
    (seed, k), not on the batch or on preemption. ``stream`` keeps the other draws at that
    position apart (0: the token's sample; DRAFT_STREAM, VERIFY_STREAM: speculative decoding's)."""
    return (seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB + 1) & _MASK64


DRAFT_STREAM, VERIFY_STREAM = 1, 2


def row_noise(shape: tuple[int, ...], generator: torch.Generator, seeds: list[int | None], output_indices: list[int],
              stream: int, device: torch.device) -> torch.Tensor:
    """Uniform noise, a row per request: a seeded request's row depends only on (seed, output
    index, stream), the others' come from the shared generator."""
    noise = torch.empty(shape, device=device).uniform_(generator=generator)
    for i, seed in enumerate(seeds):
        if seed is not None:
            gen = torch.Generator(device=device).manual_seed(step_seed(seed, output_indices[i], stream))
            noise[i].uniform_(generator=gen)
    return noise


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One draw from each row of probs, given uniform noise of its shape (consumed): argmax(p / E)
    with E = -log U ~ Exp(1). On the CPU, uniform_ then log_ is several times faster than
    exponential_, which would otherwise cost as much as a decode step's GEMMs
    (benchmarks/design_choices.py: sampling_draw)."""
    return (probs / noise.log_().neg_()).max(dim=-1).indices
