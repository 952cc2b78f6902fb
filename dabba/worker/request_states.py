"""The worker's view of each request, kept between steps (the scheduler sends only what changed),
and the flat inputs it builds from them every step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dabba.core.multimodal import MultiModalFeature
from dabba.core.outputs import SchedulerOutput
from dabba.layers.pooler import PoolingState
from dabba.pooling_params import PoolingParams
from dabba.sampling_params import SamplingParams
from dabba.worker.block_table import BlockTables
from dabba.worker.image_inputs import ImageEmbeddings
from dabba.worker.model_inputs import FlatBatch, ModelInputs, PoolingChunk
from dabba.worker.mrope_positions import step_positions
from dabba.worker.spec_decode.ngram import PackedTokens

SPEC_MISSES_BEFORE_PAUSE = 3
SPEC_MAX_PAUSE = 64


@dataclass
class CachedRequestState:
    request_id: str
    token_ids: list[int]  # prompt + outputs; the worker appends what it samples
    sampling_params: SamplingParams
    num_computed_tokens: int
    num_prompt_tokens: int  # where the outputs start (also for resumed requests)
    eos_token_ids: frozenset[int] = frozenset()
    packed: PackedTokens = field(default_factory=PackedTokens)  # token_ids as the n-gram proposer searches them
    spec_misses: int = 0  # drafts in a row of which none was accepted
    spec_pause: int = 0  # steps left without proposals (text with nothing to look up costs no drafts)
    draft_probs: Any = None  # a draft model's q for its pending drafts ([k, vocab] tensor), sampled requests only
    draft_computed: int | None = None  # tokens whose KV a draft model has written (None: not yet looked up)
    pooling_params: PoolingParams | None = None  # a pooling request: its hidden states pooled, nothing sampled
    pooling: PoolingState = field(default_factory=PoolingState)  # its pooling so far, chunk by chunk
    token_type_ids: list[int] | None = None  # a cross-encoder's text pair
    mm_features: list[MultiModalFeature] = field(default_factory=list)  # its images
    lora: Any = None  # its LoRARequest; None: the base model
    mrope: Any = None  # M-RoPE models: its prompt's positions and the delta after (worker/mrope_positions.py)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def record_drafts(self, num_accepted: int) -> None:
        """After SPEC_MISSES_BEFORE_PAUSE drafts in a row with none accepted, proposals pause for
        2, 4, 8 ... (at most SPEC_MAX_PAUSE) steps, so text with nothing to look up costs
        about what plain decoding does; one accepted token ends the pause for good."""
        self.spec_misses = 0 if num_accepted else self.spec_misses + 1
        if self.spec_misses >= SPEC_MISSES_BEFORE_PAUSE:
            self.spec_pause = min(2 ** (self.spec_misses - SPEC_MISSES_BEFORE_PAUSE + 1), SPEC_MAX_PAUSE)


class RequestStates:
    """Per-request state kept between steps; the scheduler sends only what changed."""

    def __init__(self) -> None:
        self.states: dict[str, CachedRequestState] = {}
        self.block_tables = BlockTables()

    def update(self, sched: SchedulerOutput) -> None:
        for request_id in sched.finished_req_ids:
            self.states.pop(request_id, None)
            self.block_tables.remove(request_id)
        for new in sched.scheduled_new_reqs:
            self.states[new.request_id] = CachedRequestState(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                sampling_params=new.sampling_params,
                num_computed_tokens=new.num_computed_tokens,
                num_prompt_tokens=len(new.token_ids) - new.num_output_tokens,
                eos_token_ids=new.eos_token_ids,
                pooling_params=new.pooling_params,
                token_type_ids=new.token_type_ids,
                mm_features=new.mm_features,
                lora=new.lora,
            )
            self.block_tables.add(new.request_id, new.block_ids)
        for cached in sched.scheduled_cached_reqs:
            self.states[cached.request_id].num_computed_tokens = cached.num_computed_tokens
            self.block_tables.append(cached.request_id, cached.new_block_ids)

    def prepare_inputs(self, sched: SchedulerOutput, block_size: int, device: torch.device,
                       images: ImageEmbeddings | None = None) -> ModelInputs:
        """Flatten all scheduled tokens of all requests into one batch::

            request i contributes token_ids[num_computed : num_computed + num_scheduled]
            at positions num_computed .. num_computed + num_scheduled - 1

        where a request with draft tokens (speculative decoding) has its last known token then
        its drafts; each of those positions gives a logits row, to verify the draft after it.
        ``images``: a vision-language model's image embeddings (their rows replace their tokens').
        """
        req_ids = list(sched.num_scheduled_tokens)
        num_sched = np.fromiter(sched.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        states = [self.states[r] for r in req_ids]
        num_computed = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        batch = FlatBatch.of(num_computed, num_sched)
        query_start_loc, seq_lens, positions = batch.query_start_loc, batch.seq_lens, batch.positions

        drafts = [sched.scheduled_spec_decode_tokens.get(r, []) for r in req_ids]
        input_ids = np.empty(len(positions), dtype=np.int64)
        for i, s in enumerate(states):
            known = s.token_ids[num_computed[i]:seq_lens[i]]
            input_ids[query_start_loc[i]:query_start_loc[i + 1]] = known + drafts[i] if drafts[i] else known
        image_embeds = key_ends = None
        rope_positions = positions
        if images is not None:
            image_embeds, key_ends = images.step_rows(states, query_start_loc, seq_lens, positions, device)
            if images.mrope_merge and any(s.mm_features for s in states):
                rope_positions = step_positions(states, batch, images.mrope_merge)
        attn = [batch.metadata(self.block_tables.gather(req_ids, g), block_size, device, key_ends)
                for g in range(len(self.block_tables.tables))]

        # A request samples when this step reaches the end of its known tokens (and drafts); a
        # pooling request never does: its rows are pooled, and the step that ends its input pools it.
        samples = [s.pooling_params is None and seq_lens[i] == len(s.token_ids) + len(drafts[i])
                   for i, s in enumerate(states)]
        pooling = [PoolingChunk(r, slice(int(query_start_loc[i]), int(query_start_loc[i + 1])), int(num_computed[i]),
                                bool(seq_lens[i] == len(s.token_ids)))
                   for i, (r, s) in enumerate(zip(req_ids, states)) if s.pooling_params is not None]
        num_rows = [1 + len(drafts[i]) for i in range(len(req_ids)) if samples[i]]
        ends = query_start_loc[1:][np.array(samples, dtype=bool)]
        logits_indices = np.concatenate([np.arange(end - rows, end) for end, rows in zip(ends, num_rows)]
                                        ) if num_rows else np.zeros(0, dtype=np.int64)
        token_type_ids = None
        if any(s.token_type_ids is not None for s in states):  # a cross-encoder's pairs (an encoder: whole inputs)
            types = np.zeros(len(positions), dtype=np.int64)
            for i, s in enumerate(states):
                if s.token_type_ids is not None:
                    types[query_start_loc[i]:query_start_loc[i + 1]] = s.token_type_ids[num_computed[i]:seq_lens[i]]
            token_type_ids = torch.from_numpy(types).to(device)
        return ModelInputs(
            input_ids=torch.from_numpy(input_ids).to(device),
            positions=torch.from_numpy(rope_positions).to(device),
            attn=attn,
            logits_indices=torch.from_numpy(logits_indices).to(device),
            sampling_req_ids=[r for r, s in zip(req_ids, samples) if s],
            num_rows=num_rows,
            pooling=pooling,
            token_type_ids=token_type_ids,
            image_embeds=image_embeds,
        )

    def append_sampled(self, sampled: dict[str, list[int]]) -> None:
        for request_id, token_ids in sampled.items():
            self.states[request_id].token_ids.extend(token_ids)
