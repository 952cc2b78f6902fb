"""Turn the last-token logits of every sampling request into token ids: one call per step for
the whole batch, every per-request setting a tensor row, no Python loop over the vocabulary.

Order (vLLM's): raw logprobs -> logit_bias -> min_tokens ban -> penalties -> greedy argmax |
temperature -> top_k -> top_p -> min_p (transformers' warper order and boundary rules) -> sample
-> (a draft model's proposal in the row) rejection sampling.

Speculative decoding with a draft model: a row that verifies a draft token d drawn from the
draft's distribution q keeps d with probability min(1, p(d) / q(d)), else draws from
norm(max(0, p - q)): the token that comes out is distributed as p, whatever q is (Leviathan et
al. 2023, Chen et al. 2023). A rejected row's token is never d (p(d) < q(d) there), so the model
runner keeps a request's rows while each equals its draft.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dabba.ops.native import use_cpu_kernels

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
    with E = -log U ~ Exp(1). On the CPU, uniform_ then log_ is 4x faster than exponential_ (27 ms
    for 32 x 49152 draws), which would otherwise cost as much as a decode step's GEMMs."""
    return (probs / noise.log_().neg_()).max(dim=-1).indices


def warp(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution a sampled row draws from: temperature, top_k, top_p, min_p, softmax."""
    temperature = torch.where(md.temperature == 0, 1.0, md.temperature)
    logits = logits / temperature[:, None]
    if md.top_k is not None:
        logits = apply_top_k(logits, md.top_k)
    if md.top_p is not None:
        logits = apply_top_p(logits, md.top_p)
    if md.min_p is not None:
        logits = apply_min_p(logits, md.min_p)
    return logits.softmax(dim=-1)


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


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [num_reqs] int64
    # Rows that asked for logprobs: [num_reqs, 1 + max N] ids and logprobs, the sampled token
    # first, then the top N; and the sampled token's rank (1 = most likely).
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """repetition (prompt or output tokens: divide positive logits, multiply negative ones),
    then frequency (times the count) and presence (once), on output tokens only."""
    counts = md.output_counts
    seen = counts > 0
    rep = md.repetition_penalty[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen | md.prompt_mask, penalised, logits)
    return logits - md.frequency_penalty[:, None] * counts - md.presence_penalty[:, None] * seen


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    # transformers: remove scores below the k-th largest (ties with it stay)
    k_max = int(top_k.max())
    kth = logits.topk(k_max, dim=-1).values.gather(1, (top_k.clamp(max=k_max) - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    # transformers: ascending sort; drop the tail whose cumulative mass is <= 1 - p; keep the top token
    sorted_logits, order = logits.sort(dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p)[:, None]
    remove[:, -1] = False
    return logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    # transformers: drop tokens whose probability is below min_p times the top probability
    probs = logits.softmax(dim=-1)
    remove = probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(remove, float("-inf"))


# bits of a byte, for the reference: _BYTE_BITS[b, i] = bit i of b is set
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
    """Structured outputs: tokens that a grammar forbids get -inf, in place, in logits row
    rows[i] for bitmask row i (bit t of word t // 32 allows token t); other rows are untouched.
    The native kernel on the CPU (csrc/sampling_cpu.cpp), else this file's PyTorch form, the
    reference they are held equal to."""
    words = torch.from_numpy(bitmask)  # [len(rows), ceil(vocab / 32)] int32
    index = torch.tensor(rows, dtype=torch.long)
    if use_cpu_kernels(logits) and logits.dtype == torch.float32 and logits.stride(1) == 1:
        torch.ops.dabba_cpu.apply_token_bitmask(logits, words, index)
        return
    apply_grammar_bitmask_reference(logits, words.to(logits.device), index.to(logits.device))


def apply_grammar_bitmask_reference(logits: torch.Tensor, words: torch.Tensor, index: torch.Tensor) -> None:
    vocab = logits.shape[1]
    if not len(index):
        return
    allowed = _BYTE_BITS.to(logits.device)[words.view(torch.uint8).long()].view(len(index), -1)[:, :vocab]
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (a NaN row: its first NaN): the native one-pass kernel on the CPU
    (csrc/sampling_cpu.cpp, bf16 read as it is), else the reference it is held equal to.
    max(dim).indices is argmax with those rules, at a third of argmax's time on the CPU (3.2
    against 11.0 ms over 32 x 262144 float32 logits)."""
    if use_cpu_kernels(logits) and logits.dim() == 2 and logits.stride(1) == 1 \
            and logits.dtype in (torch.float32, torch.bfloat16):
        return torch.ops.dabba_cpu.argmax_rows(logits)
    return logits.max(dim=-1).indices


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        # logits: [num_reqs, vocab], the model's own, in the model's dtype or float32
        wants_logprobs = any(n is not None for n in md.num_logprobs)
        if md.all_greedy and not wants_logprobs and md.bias_index is None and md.banned_index is None \
                and md.output_counts is None:
            return SamplerOutput(sampled=argmax_rows(logits))  # nothing changes a logit: no float32 copy
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if wants_logprobs else None

        if md.bias_index is not None:
            logits = logits.index_put(md.bias_index, md.bias_value, accumulate=True)
        if md.banned_index is not None:
            logits = logits.index_put(md.banned_index, torch.tensor(float("-inf"), device=logits.device))
        if md.output_counts is not None:
            logits = apply_penalties(logits, md)

        sampled = argmax_rows(logits)
        if not md.all_greedy:
            sampled = torch.where(md.temperature == 0, sampled, self._sample(logits, md))
        out = SamplerOutput(sampled=sampled)
        if raw_logprobs is not None:
            self._gather_logprobs(raw_logprobs, out, md)
        return out

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        probs = warp(logits, md)
        sampled = race(probs, row_noise(probs.shape, self.generator, md.seeds, md.output_indices, 0, probs.device))
        if md.draft_rows is not None:
            sampled[md.draft_rows] = self._verify_drafts(probs[md.draft_rows], md)
        return sampled

    def _verify_drafts(self, p: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Rejection sampling of the draft rows: each row's draft token, or a draw from the residual."""
        q, d = md.draft_probs, md.draft_token_ids
        rows = md.draft_rows.tolist()
        draws = row_noise((len(rows), 1 + p.shape[1]), self.generator, [md.seeds[r] for r in rows],
                          [md.output_indices[r] for r in rows], VERIFY_STREAM, p.device)
        u, noise = draws[:, 0], draws[:, 1:]  # the acceptance test's, then the residual draw's
        p_d, q_d = p.gather(1, d[:, None])[:, 0], q.gather(1, d[:, None])[:, 0]
        accept = u * q_d < p_d
        residual = race((p - q).clamp_(min=0), noise)
        return torch.where(accept, d, residual)

    @staticmethod
    def _gather_logprobs(raw_logprobs: torch.Tensor, out: SamplerOutput, md: SamplingMetadata) -> None:
        max_n = max(n for n in md.num_logprobs if n is not None)
        sampled_lp = raw_logprobs.gather(1, out.sampled[:, None])
        top_lp, top_ids = raw_logprobs.topk(max_n, dim=-1) if max_n else (sampled_lp[:, :0], out.sampled[:, None][:, :0])
        out.logprob_token_ids = torch.cat([out.sampled[:, None], top_ids], dim=1)
        out.logprobs = torch.cat([sampled_lp, top_lp], dim=1)
        out.sampled_ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1
