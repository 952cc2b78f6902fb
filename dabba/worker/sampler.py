"""Turn the last-token logits of every sampling request into token ids: one call per step for
the whole batch, every per-request setting a tensor row, no Python loop over the vocabulary.

Order (vLLM's): raw logprobs -> logit_bias -> min_tokens ban -> penalties -> greedy argmax |
temperature -> top_k -> top_p -> min_p (transformers' warper order and boundary rules) -> sample
-> (a draft model's proposal in the row) rejection sampling (worker/spec_decode/verification.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dabba.ops.native import use_cpu_kernels
from dabba.worker.random_draws import race, row_noise
from dabba.worker.sampling_metadata import SamplingMetadata
from dabba.worker.spec_decode.verification import rejection_sample

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
    max(dim).indices is argmax with those rules, in a fraction of argmax's time on the CPU
    (benchmarks/design_choices.py: argmax_rows)."""
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
            sampled[md.draft_rows] = rejection_sample(probs[md.draft_rows], md, self.generator)
        return sampled

    @staticmethod
    def _gather_logprobs(raw_logprobs: torch.Tensor, out: SamplerOutput, md: SamplingMetadata) -> None:
        max_n = max(n for n in md.num_logprobs if n is not None)
        sampled_lp = raw_logprobs.gather(1, out.sampled[:, None])
        top_lp, top_ids = raw_logprobs.topk(max_n, dim=-1) if max_n else (sampled_lp[:, :0], out.sampled[:, None][:, :0])
        out.logprob_token_ids = torch.cat([out.sampled[:, None], top_ids], dim=1)
        out.logprobs = torch.cat([sampled_lp, top_lp], dim=1)
        out.sampled_ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1
