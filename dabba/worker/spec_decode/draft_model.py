"""Draft-model proposals: a small model with the target's tokenizer guesses a request's next tokens.

Its KV cache is tensors of its own, addressed by the target's full-attention block table: block b
holds the draft's keys and values for the positions target block b holds. So what the scheduler
allocates, shares through the prefix cache, rolls back and frees holds for both models at once.
The draft keeps only how far each request's draft KV goes (``draft_computed``), and which blocks
hold whole draft KV: a prefix hit on those saves it the work; a block given out anew holds none.

After the target's step has been verified, the draft
1. catches up: runs over the request's known tokens from where its draft KV ends (prompt chunks,
   a decode's accepted tokens) and, for a request that proposes, the token just sampled, at their
   positions and slots (the KV it wrote there for proposals that were rejected is written over);
2. proposes: from that last position's logits, one token per forward, each fed back at the next
   position, in the slots the scheduler reserved past the step (``num_lookahead_tokens``).
A request whose proposals pause (they kept failing) costs the draft nothing meanwhile.

A greedy request's drafts are the draft's argmax. A sampled request's are drawn from q, the
draft's distribution under the request's temperature, top_k, top_p and min_p; q is kept with the
request for the sampler's rejection step (worker/sampler.py), which makes the output the target's
distribution whatever q is. A seeded request's draws are keyed on (seed, output index).
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dabba.arch.config import ArchConfig
from dabba.attention.kv_quant import kv_bytes_per_token
from dabba.core.kv_cache_groups import KVCacheGroup
from dabba.core.outputs import SchedulerOutput
from dabba.models.loader import load_model
from dabba.models.resolved_config import ResolvedConfig
from dabba.models.sizes import weights_bytes
from dabba.worker.layer_loop import run_layers, select_layer_loop
from dabba.worker.memory import check_fits, kv_cache_tensors
from dabba.worker.model_inputs import FlatBatch
from dabba.worker.random_draws import DRAFT_STREAM, race, row_noise
from dabba.worker.request_states import CachedRequestState, RequestStates
from dabba.worker.sampler import argmax_rows, warp
from dabba.worker.sampling_metadata import SamplingMetadata, build_sampling_metadata
from dabba.worker.spec_decode.proposer import Proposal

logger = logging.getLogger("dabba")


def check_same_vocabulary(draft_dir: Path, draft: ArchConfig, target_dir: Path, target: ArchConfig) -> None:
    """A draft proposes token ids, so its ids must mean the target's tokens."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: the draft model {draft_dir} has a vocabulary of {draft.vocab_size} "
                         f"tokens and the target {target.vocab_size}; a draft model must share the target's tokenizer")
    files = [draft_dir / "tokenizer.json", target_dir / "tokenizer.json"]
    if all(f.is_file() for f in files):
        from tokenizers import Tokenizer

        vocabularies = [Tokenizer.from_file(str(f)).get_vocab(with_added_tokens=True) for f in files]
        if vocabularies[0] != vocabularies[1]:
            raise ValueError(f"speculative_config: the draft model {draft_dir}'s tokenizer maps tokens to other ids "
                             "than the target's; a draft model must share the target's tokenizer")


class DraftModel:
    def __init__(self, resolved: ResolvedConfig, backend: Any, kv_quant: Any, generator: torch.Generator) -> None:
        """The draft of ``resolved.draft``, in the target's dtype and on its device, with the
        target's attention backend and KV format."""
        draft = resolved.draft
        model_dir, self.arch = draft.model_dir, draft.arch
        check_same_vocabulary(Path(model_dir), self.arch, Path(resolved.model_dir), resolved.arch)
        if any(self.arch.layer_sliding_window(i) is not None for i in range(self.arch.num_hidden_layers)):
            raise ValueError(f"speculative_config: the draft model {model_dir} has sliding-window layers; "
                             "a draft model must attend to the whole context")
        dtype, device = resolved.dtype, resolved.device
        self.dtype, self.device, self.max_model_len = dtype, device, resolved.max_model_len
        self.backend, self.kv_quant = backend, kv_quant
        self.num_tokens = resolved.config.scheduler_config.speculative_config.num_speculative_tokens
        self.generator = generator
        quant = draft.quant_config
        check_fits(f"the draft model {model_dir}'s weights", weights_bytes(self.arch, dtype, quant, device.type), device,
                   "take a smaller draft model, or quantize it")
        self.model = load_model(model_dir, self.arch, dtype, device, max_position=self.max_model_len, quant_config=quant)
        self.native_loop, why = select_layer_loop(self.model, backend, kv_quant,
                                                  resolved.config.model_config.native_layer_loop)
        logger.info("Draft model %s (%s, %d layers) proposes %d tokens a step; its layers run %s: %s", model_dir,
                    self.arch.architecture, self.arch.num_hidden_layers, self.num_tokens,
                    "in the native loop" if self.native_loop else "in Python", why)
        self.kv_caches: list[Any] = []
        self.block_size = 0
        # per block of the pool: whether the draft's KV of its tokens is written (hits on it save
        # the draft's work); a block given out anew is not, until the draft has passed its end
        self.valid = np.zeros(0, dtype=bool)

    def bytes_per_block(self, block_size: int, kv_cache_dtype: str, groups: tuple[KVCacheGroup, ...]) -> int:
        """Its cache has a block for each of the pool's, read through the full-attention tables."""
        if groups[0].sliding_window is not None:
            raise ValueError("speculative_config: a draft model needs a target with full-attention layers "
                             "(its cache follows their block tables); every layer of this one has a sliding window")
        arch = self.arch
        return block_size * kv_bytes_per_token(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim,
                                               kv_cache_dtype, self.dtype)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        arch = self.arch
        self.block_size = block_size
        self.valid = np.zeros(num_blocks, dtype=bool)
        self.kv_caches = kv_cache_tensors(self.backend, self.kv_quant, num_blocks, block_size, arch.num_key_value_heads,
                                          arch.head_dim, arch.num_hidden_layers, self.dtype, self.device)

    def _forward(self, requests: RequestStates, req_ids: list[str], starts: np.ndarray, lens: np.ndarray,
                 input_ids: list[int]) -> torch.Tensor:
        """Hidden states of a flat batch: request i's tokens at positions starts[i] .. + lens[i] - 1."""
        batch = FlatBatch.of(starts, lens)
        common = batch.metadata(requests.block_tables.gather(req_ids, 0), self.block_size, self.device)
        return run_layers(self.model, self.native_loop, self.backend, torch.tensor(input_ids, device=self.device),
                          torch.from_numpy(batch.positions).to(self.device), [self.backend.build_metadata(common)],
                          self.kv_caches)

    def propose(self, requests: RequestStates, sched: SchedulerOutput, sampled: list[str],
                wants: dict[str, int]) -> dict[str, Proposal]:
        """``sampled``: the requests that sampled this step (their tokens already appended);
        ``wants``: those that propose, each the most tokens it may. A request whose proposals pause,
        or that never proposes (structured outputs), costs the draft nothing: its tokens pass
        through the draft when it next proposes."""
        self._forget_new_blocks(sched)
        sampled_ids = set(sampled)
        req_ids, starts, ends, budget = [], [], [], {}
        for request_id, num_scheduled in sched.num_scheduled_tokens.items():
            state = requests.states[request_id]
            if request_id not in wants and (request_id in sampled_ids or state.sampling_params.masked):
                continue
            table = self._table(requests, request_id)
            if state.draft_computed is None:  # first seen: a prefix hit's blocks may hold its KV already
                state.draft_computed = self._valid_prefix(table, state.num_computed_tokens)
            last = len(state.token_ids) - 1  # the newest token's position
            end = min(state.num_computed_tokens + num_scheduled, last)
            if request_id in wants:
                m = min(wants[request_id], len(table) * self.block_size - last, self.max_model_len - last)
                if m >= 1:
                    budget[request_id] = m
                    end = last + 1  # its newest token too: the first proposal comes from it
            if end > state.draft_computed:
                req_ids.append(request_id)
                starts.append(state.draft_computed)
                ends.append(end)
        if not req_ids:
            return {}
        starts_np, ends_np = np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64)
        input_ids = [t for r, s, e in zip(req_ids, starts, ends) for t in requests.states[r].token_ids[s:e]]
        hidden = self._forward(requests, req_ids, starts_np, ends_np - starts_np, input_ids)
        for request_id, end in zip(req_ids, ends):  # the blocks now whole in its draft KV serve prefix hits
            state = requests.states[request_id]
            table = self._table(requests, request_id)
            self.valid[table[state.draft_computed // self.block_size:end // self.block_size]] = True
            state.draft_computed = end
        proposing = [r for r in req_ids if r in budget]
        if not proposing:
            return {}
        last_rows = np.cumsum(ends_np - starts_np) - 1  # each fed request's newest token
        rows = [int(last) for r, last in zip(req_ids, last_rows) if r in budget]
        states = [requests.states[r] for r in proposing]
        md = build_sampling_metadata([_plain(s) for s in states], self.arch.vocab_size, self.device)
        tokens: dict[str, list[int]] = {r: [] for r in proposing}
        probs: dict[str, list[torch.Tensor]] = {r: [] for r in proposing}
        active = list(range(len(proposing)))
        logits = self.model.compute_logits(hidden[rows])
        for j in range(max(budget.values())):
            drawn, q = self._draw(logits, _rows(md, active), [states[i] for i in active], j)
            for k, i in enumerate(active):
                r = proposing[i]
                tokens[r].append(drawn[k])
                if q is not None and not states[i].sampling_params.greedy:
                    probs[r].append(q[k])
            active = [i for i in active if budget[proposing[i]] > j + 1]
            if not active:
                break
            # feed each active request's newest draft at the position after its newest token + j
            positions = np.array([len(states[i].token_ids) + j for i in active], dtype=np.int64)
            hidden = self._forward(requests, [proposing[i] for i in active], positions, np.ones(len(active), np.int64),
                                   [tokens[proposing[i]][-1] for i in active])
            logits = self.model.compute_logits(hidden)
        return {r: Proposal(tokens[r], torch.stack(probs[r]) if probs[r] else None) for r in proposing}

    def _table(self, requests: RequestStates, request_id: str) -> np.ndarray:
        """The request's full-attention block table (the draft's cache follows it)."""
        tables = requests.block_tables
        row = tables.row_of[request_id]
        return tables.tables[0][row, : tables.lengths[0][row]]

    def _forget_new_blocks(self, sched: SchedulerOutput) -> None:
        """Blocks handed out anew this step (not prefix hits) hold no draft KV of their tokens yet."""
        bs = self.block_size
        for new in sched.scheduled_new_reqs:
            self.valid[new.block_ids[0][new.num_computed_tokens // bs:]] = False
        for cached in sched.scheduled_cached_reqs:
            self.valid[cached.new_block_ids[0]] = False

    def _valid_prefix(self, table: np.ndarray, num_hit_tokens: int) -> int:
        """Tokens at the start of a new request whose draft KV its prefix-hit blocks already hold."""
        hits = self.valid[table[: num_hit_tokens // self.block_size]]
        return int(hits.argmin() if not hits.all() else len(hits)) * self.block_size

    def _draw(self, logits: torch.Tensor, md: SamplingMetadata, states: list[CachedRequestState],
              j: int) -> tuple[list[int], torch.Tensor | None]:
        """Each row's j-th draft token: greedy rows the argmax, sampled rows a draw from q (returned)."""
        drawn = argmax_rows(logits)
        if md.all_greedy:
            return drawn.tolist(), None
        q = warp(logits.float(), md)
        noise = row_noise(q.shape, self.generator, [s.sampling_params.seed for s in states],
                          [s.num_output_tokens + j for s in states], DRAFT_STREAM, q.device)
        drawn = torch.where(md.temperature == 0, drawn, race(q, noise))
        return drawn.tolist(), q


def _plain(state: CachedRequestState) -> CachedRequestState:
    """The state as q sees it: the request's warping (temperature, top_k, top_p, min_p), without
    penalties, bias or bans, which only the target's distribution takes (q may be any distribution)."""
    p = state.sampling_params
    return dataclasses.replace(state, sampling_params=dataclasses.replace(
        p, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=None, min_tokens=0,
        logprobs=None))


def _rows(md: SamplingMetadata, index: list[int]) -> SamplingMetadata:
    """The warping settings of some rows (what ``warp`` reads)."""
    if index == list(range(len(md.temperature))):
        return md
    idx = torch.tensor(index, device=md.temperature.device)
    pick = lambda t: None if t is None else t[idx]  # noqa: E731
    return dataclasses.replace(md, temperature=md.temperature[idx], top_k=pick(md.top_k), top_p=pick(md.top_p),
                               min_p=pick(md.min_p))
