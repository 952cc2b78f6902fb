"""Runs one step: all scheduled tokens of all requests as one flat batch, one forward pass.

prepare inputs -> forward (under forward_context) -> logits of sampling rows -> sample -> verify
drafts -> propose the next drafts.

Speculative decoding plugs in through two modules: the proposer (worker/spec_decode/proposer.py,
whichever selector.py picks: n-gram lookup or a draft model) proposes after each step, and the
drafts it proposed are verified in the next one's forward (worker/spec_decode/verification.py: a
logits row per draft position, sampled as plain decoding would, and the tokens accepted).

The forward runs the model's Python layers (the reference) or the native layer loop, the same
layers in C++ (models/native_layer_loop.py); worker/layer_loop.py makes that choice once per model.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from dabba.attention.kv_quant import kv_bytes_per_token, make_kv_quant
from dabba.attention.selector import get_attention_backend
from dabba.config import CacheConfig
from dabba.core.kv_cache_groups import KVCacheGroup, group_layers, group_size, layer_slots
from dabba.core.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from dabba.core.spec_budget import RowBlocks
from dabba.distributed.tensor_parallel import SINGLE, KVHeadShard, TensorParallel
from dabba.layers.lora import lora_rows
from dabba.layers.pooler import Pooler
from dabba.models.loader import load_model
from dabba.models.resolved_config import ResolvedConfig
from dabba.models.sizes import weights_bytes
from dabba.ops import native
from dabba.worker.image_inputs import EncoderWork, ImageEmbeddings
from dabba.worker.kv_offload import DiskStore, HostKVTier, disk_tier_dir
from dabba.worker.layer_loop import run_layers, select_layer_loop
from dabba.worker.lora_manager import LoRAManager
from dabba.worker.memory import (check_fits, default_kv_cache_memory, keep_freed_host_memory, kv_bytes_for_sequences,
                                 kv_cache_tensors)
from dabba.worker.model_inputs import ModelInputs
from dabba.worker.request_states import RequestStates
from dabba.worker.sampler import Sampler, apply_grammar_bitmask
from dabba.worker.sampling_metadata import build_sampling_metadata
from dabba.worker.spec_decode.selector import make_proposer
from dabba.worker.spec_decode.verification import accepted_tokens, draft_rows, row_states

logger = logging.getLogger("dabba")

PROMPT_LOGPROBS_ROWS = 256  # prompt rows turned into full-vocabulary logits at once


@dataclass(frozen=True)
class CacheLayout:
    """Derived at start-up from the memory budget; never written back into CacheConfig."""

    num_blocks: int
    block_size: int
    bytes_per_block: int  # a block of every layer position of a group (kv_cache_groups.group_size), and the draft model's
    kv_cache_memory: int  # the budget the blocks were carved from
    groups: tuple[KVCacheGroup, ...]  # layers sharing a block table (core/kv_cache_groups.py)


class ModelRunner:
    """One rank's model, KV cache, batch state and sampler. Under tensor parallelism every rank
    runs the same steps on its shard; the collectives inside the layers keep them in step, and
    every rank samples the same tokens from the same gathered logits and seeds."""

    def __init__(self, resolved: ResolvedConfig, tp: TensorParallel = SINGLE) -> None:
        arch, dtype, device, quant_config = resolved.arch, resolved.dtype, resolved.device, resolved.quant_config
        model_dir, max_model_len = resolved.model_dir, resolved.max_model_len
        mc, kv_cache_dtype = resolved.config.model_config, resolved.config.cache_config.kv_cache_dtype
        self.resolved = resolved
        self.arch = arch
        self.dtype = dtype
        self.device = device
        self.max_model_len = max_model_len
        self.tp = tp
        self.num_kv_heads = KVHeadShard.of(tp.rank, tp.size, arch.num_key_value_heads).num_local  # this rank's
        if device.type == "cpu":
            keep_freed_host_memory()
            native.load_cpu_ops()  # now, so that no request waits for a first build or load (it logs the variant)
        check_fits(f"the weights of {model_dir} ({str(dtype).removeprefix('torch.')}"
                   f"{', ' + quant_config.method if quant_config else ''}"
                   f"{f', a rank of {tp.size}' if tp.size > 1 else ''})",
                   weights_bytes(arch, dtype, quant_config, device.type, tp_size=tp.size), device,
                   "quantize them (quantization int8 or int4) or take a smaller model; `dabba plan` shows what fits")
        start = time.perf_counter()
        self.model = load_model(model_dir, arch, dtype, device, max_position=max_model_len, quant_config=quant_config,
                                tp=tp, pooling=resolved.runner == "pooling", vision_quantization=mc.vision_quantization)
        self.pooler = Pooler(resolved.pooler_config) if resolved.pooler_config is not None else None
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_quant = make_kv_quant(kv_cache_dtype, dtype)
        self.backend = get_attention_backend(mc.attention_backend, device, self.kv_quant)
        # parameters plus quantized weight buffers; RoPE tables are not weights
        tensors = [*self.model.parameters(), *(b for n, b in self.model.named_buffers() if "rotary" not in n)]
        self.weight_bytes = sum(t.numel() * t.element_size() for t in tensors)
        logger.info("Loaded %s (%.1f MiB of weights, %s%s%s) on %s in %.1f s; attention backend %s", arch.architecture,
                    self.weight_bytes / 2**20, str(dtype).removeprefix("torch."),
                    f", {quant_config.method}" if quant_config else "",
                    f", tensor-parallel rank {tp.rank} of {tp.size}" if tp.size > 1 else "",
                    device, time.perf_counter() - start, type(self.backend).__name__)
        lora = resolved.config.lora_config
        self.loras = LoRAManager(self.model, lora.max_loras, lora.max_lora_rank, dtype, device) \
            if lora.enable_lora else None
        self.native_loop, self.layer_loop_reason = select_layer_loop(self.model, self.backend, self.kv_quant,
                                                                     mc.native_layer_loop, tp, lora.enable_lora)
        logger.info("Layers run %s: %s", "in the native loop (csrc/decode_cpu.cpp)" if self.native_loop
                    else "in Python", self.layer_loop_reason)
        self.sampler = Sampler(device, mc.seed)
        self.host_tier = HostKVTier()  # holds blocks only where the engine offloads (kv_offload_memory)
        if resolved.config.cache_config.kv_offload_dir is not None:
            directory = disk_tier_dir(resolved)
            self.host_tier.disk = DiskStore(directory, directory.name)
        self.proposer = make_proposer(resolved, self.backend, self.kv_quant, self.sampler.generator)
        self.requests = RequestStates()
        images = arch.images
        self.images = None if images is None else ImageEmbeddings(
            self.model.encode_steps, images.bidirectional, images.vision.spatial_merge_size if images.mrope else 0)
        self.kv_caches: list = []  # per layer: a tensor, or (codes, scales) for an 8-bit cache
        self.layer_groups: list[int] | None = None  # per layer: its KV-cache group; None: one group
        self.layout: CacheLayout | None = None

    def row_blocks(self) -> RowBlocks:
        """How this model's linears group a step's rows, for the scheduler's draft budget: the CPU
        kernels' GEMV and GEMM blocks for bf16 weights, else no blocking."""
        if self.device.type != "cpu" or self.dtype != torch.bfloat16:
            return RowBlocks()
        return RowBlocks(*native.linear_row_blocks(self.arch.hidden_size))

    def initialize_kv_cache(self, cache_config: CacheConfig, max_num_seqs: int, max_chunk: int) -> CacheLayout:
        """Carve the budget into blocks of the shared pool. Layers are grouped by attention kind
        (a sliding-window group frees what its window has passed); a block holds one block of
        each layer position of a group, and layer j of every group lives in cache tensor j."""
        bs = cache_config.block_size
        arch = self.arch
        if arch.encoder is not None:
            return self._encoder_layout(bs, max_num_seqs)
        groups = tuple(group_layers([arch.layer_sliding_window(i) for i in range(arch.num_hidden_layers)]))
        num_tensors = group_size(groups)
        bytes_per_block = bs * kv_bytes_per_token(num_tensors, self.num_kv_heads, arch.head_dim,
                                                  self.kv_cache_dtype, self.dtype)
        if self.proposer is not None:  # a draft model's own KV, a block for each of the pool's
            bytes_per_block += self.proposer.bytes_per_block(bs, self.kv_cache_dtype, groups)
        budget = cache_config.kv_cache_memory
        if budget is None:
            budget = default_kv_cache_memory(self.device, kv_bytes_for_sequences(
                groups, bs, bytes_per_block, self.max_model_len, max_num_seqs, max_chunk))
        if cache_config.kv_cache_memory is not None:  # a default budget is a share of what is there
            check_fits("the KV cache (kv_cache_memory)", budget, self.device, "ask for a smaller KV cache")
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={budget} bytes is less than one KV block ({bytes_per_block} bytes)")
        tensors = kv_cache_tensors(self.backend, self.kv_quant, num_blocks, bs, self.num_kv_heads, arch.head_dim,
                                   num_tensors, self.dtype, self.device)
        slots = layer_slots(groups)
        self.kv_caches = [tensors[slots[i][1]] for i in range(arch.num_hidden_layers)]
        if self.proposer is not None:
            self.proposer.allocate_kv_cache(num_blocks, bs)
        self.layer_groups = None if len(groups) == 1 else [slots[i][0] for i in range(arch.num_hidden_layers)]
        self.layout = CacheLayout(num_blocks, bs, bytes_per_block, budget, groups)
        sliding = [g for g in groups if g.sliding_window is not None]
        logger.info(
            "KV cache (%s): %d blocks of %d tokens (%.1f MiB); holds %.2f concurrent sequences of max_model_len=%d%s",
            self.kv_cache_dtype, num_blocks, bs, num_blocks * bytes_per_block / 2**20,
            num_blocks / sum(g.blocks_needed(self.max_model_len, bs, max_chunk) for g in groups), self.max_model_len,
            f"; {len(groups)} groups of {num_tensors} layers, {len(sliding)} of them sliding-window (their blocks "
            "are freed once the window passes)" if sliding else "",
        )
        return self.layout

    def _encoder_layout(self, block_size: int, max_num_seqs: int) -> CacheLayout:
        """An encoder keeps no KV (its input runs whole in one step): its blocks are the scheduler's
        accounting of a step's tokens only, and no memory holds them."""
        num_blocks = max_num_seqs * -(-self.max_model_len // block_size)
        groups = (KVCacheGroup(tuple(range(self.arch.num_hidden_layers)), None),)
        self.kv_caches = [None] * self.arch.num_hidden_layers
        self.layout = CacheLayout(num_blocks, block_size, 0, 0, groups)
        logger.info("No KV cache: an encoder attends within each input, in one step")
        return self.layout

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        # the disk tier's reads that ended (an empty step waits a little for one: a prompt waits for them)
        fetched = self.host_tier.drain(0.02 if sched.is_empty else 0.0)
        if sched.kv_transfers is not None:  # the tiers' copies, before the forward writes any block
            self.host_tier.apply(sched.kv_transfers, self.kv_caches)
        output = self._execute(sched)
        if sched.kv_transfers is not None:  # the blocks the forward computed, to the disk tier
            self.host_tier.persist(sched.kv_transfers, self.kv_caches)
        output.kv_fetched, output.kv_fetch_failed = fetched
        return output

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.requests.update(sched)
        encoding = self.images.update(sched) if self.images is not None else None
        if sched.is_empty:
            return self._encoder_output(ModelRunnerOutput(), encoding)
        assert self.layout is not None, "initialize_kv_cache() first"
        inputs = self.requests.prepare_inputs(sched, self.layout.block_size, self.device, self.images)
        metadata = [self.backend.build_metadata(common) for common in inputs.attn]
        adapters = None if self.loras is None else self.loras.step_rows(
            [self.requests.states[r].lora for r in sched.num_scheduled_tokens],
            list(sched.num_scheduled_tokens.values()), self.device)
        with lora_rows(adapters):
            hidden = run_layers(self.model, self.native_loop, self.backend, inputs.input_ids, inputs.positions,
                                metadata, self.kv_caches, self.layer_groups, inputs.token_type_ids,
                                inputs.image_embeds)  # [num_tokens, hidden]
        output = self._encoder_output(ModelRunnerOutput(prompt_logprobs=self._prompt_logprobs(sched, inputs, hidden)),
                                      encoding)
        if inputs.pooling:
            output.pooler_output = self._pool(inputs, hidden)
        if not inputs.sampling_req_ids:
            if self.proposer is not None:  # nothing to propose from, but a draft model's KV keeps up
                self.proposer.propose(self.requests, sched, [], {})
            return output
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [rows, vocab]
        first_rows = list(itertools.accumulate(inputs.num_rows, initial=0))[:-1]  # each request's first row
        if sched.grammar_bitmask is not None:  # structured outputs (one row each): before every sampler feature
            logits = logits.float()
            row_of = dict(zip(inputs.sampling_req_ids, first_rows))
            apply_grammar_bitmask(logits, sched.grammar_bitmask, [row_of[r] for r in sched.structured_output_request_ids])
        drafts = [sched.scheduled_spec_decode_tokens.get(r, []) for r in inputs.sampling_req_ids]
        rows = row_states(self.requests.states, inputs.sampling_req_ids, drafts)
        md = build_sampling_metadata(rows, self.arch.vocab_size, self.device)
        draft_rows(md, self.requests.states, inputs.sampling_req_ids, first_rows, drafts, self.device)
        sampler_out = self.sampler(logits, md)
        sampled = sampler_out.sampled.tolist()
        if sampler_out.logprobs is not None:
            ids, lps, ranks = (sampler_out.logprob_token_ids.tolist(), sampler_out.logprobs.tolist(),
                               sampler_out.sampled_ranks.tolist())
        for request_id, first, draft in zip(inputs.sampling_req_ids, first_rows, drafts):
            tokens = accepted_tokens(sampled[first:first + 1 + len(draft)], draft)
            output.sampled_token_ids[request_id] = tokens
            if draft:
                self.requests.states[request_id].record_drafts(len(tokens) - 1)
            n = self.requests.states[request_id].sampling_params.logprobs
            if n is not None:
                output.logprobs[request_id] = [TokenLogprobs(ids[r][: n + 1], lps[r][: n + 1], ranks[r])
                                               for r in range(first, first + len(tokens))]
        self.requests.append_sampled(output.sampled_token_ids)
        if self.proposer is not None:
            start = time.perf_counter()
            output.spec_token_ids, output.draft_passes = self._propose(sched, inputs.sampling_req_ids)
            output.draft_seconds = time.perf_counter() - start
        return output

    @staticmethod
    def _encoder_output(output: ModelRunnerOutput, work: EncoderWork | None) -> ModelRunnerOutput:
        if work is not None:
            output.encoded_images, output.encoder_units = work.encoded, work.units
            output.encoder_work, output.encoder_seconds = work.operations, work.seconds
        return output

    def _propose(self, sched: SchedulerOutput, request_ids: list[str]) -> tuple[dict[str, list[int]], int]:
        """Drafts for the next step of each request that sampled (none under structured outputs,
        whose grammar would have to walk them, nor while a request's proposals pause), and the
        most any request was allowed (a draft model's passes)."""
        wants = {}
        for request_id in request_ids:
            state = self.requests.states[request_id]
            state.draft_probs = None
            if state.sampling_params.masked:  # a grammar or a thinking budget would have to walk them
                continue
            if state.spec_pause > 0:
                state.spec_pause -= 1
                continue
            allowed = sched.spec_token_budget.get(request_id, self.proposer.num_tokens)
            if allowed > 0:
                wants[request_id] = allowed
        proposals = self.proposer.propose(self.requests, sched, request_ids, wants)  # a draft model catches up too
        for request_id, proposal in proposals.items():
            self.requests.states[request_id].draft_probs = proposal.probs
        return ({request_id: proposal.token_ids for request_id, proposal in proposals.items()},
                max(wants.values(), default=0))

    def _pool(self, inputs: ModelInputs, hidden: torch.Tensor) -> dict[str, list[float]]:
        """Each pooling request's rows into its pooling; the embedding of each whose input ended."""
        assert self.pooler is not None, "pooling requests reach a model with a pooler only"
        pooled = {}
        for chunk in inputs.pooling:
            state = self.requests.states[chunk.request_id]
            rows = hidden[chunk.rows]  # [num_tokens, hidden]
            self.pooler.add(state.pooling, rows, chunk.first_position)
            if chunk.finishes:
                vector = self.pooler.pooled(state.pooling, rows[-1], state.pooling_params)
                if self.pooler.config.task == "score":  # a cross-encoder: its classifier's logit
                    vector = self.model.classify(vector[None].to(self.dtype))[0]
                pooled[chunk.request_id] = vector.tolist()
        return pooled

    def _prompt_logprobs(self, sched: SchedulerOutput, inputs: ModelInputs, hidden: torch.Tensor) -> dict:
        """For requests asking prompt_logprobs, the logprob of each prompt token this step's chunk
        predicts: the token at position p + 1 from the hidden state at position p."""
        result = {}
        for i, (request_id, num_scheduled) in enumerate(sched.num_scheduled_tokens.items()):
            state = self.requests.states[request_id]
            n = state.sampling_params.prompt_logprobs
            start = state.num_computed_tokens  # position of the chunk's first token
            num_rows = min(num_scheduled, state.num_prompt_tokens - 1 - start)
            if n is None or num_rows <= 0:
                continue
            first_row = int(inputs.attn[0].query_start_loc[i])
            targets = torch.tensor(state.token_ids[start + 1:start + 1 + num_rows], device=self.device)
            entries = []
            for lo in range(0, num_rows, PROMPT_LOGPROBS_ROWS):  # bound the [rows, vocab] logits
                hi = min(lo + PROMPT_LOGPROBS_ROWS, num_rows)
                lp = self.model.compute_logits(hidden[first_row + lo:first_row + hi]).float().log_softmax(dim=-1)
                target_lp = lp.gather(1, targets[lo:hi, None])
                top_lp, top_ids = lp.topk(n, dim=-1)
                ranks = ((lp > target_lp).sum(dim=-1) + 1).tolist()
                ids = torch.cat([targets[lo:hi, None], top_ids], dim=1).tolist()
                lps = torch.cat([target_lp, top_lp], dim=1).tolist()
                entries += [TokenLogprobs(a, b, r) for a, b, r in zip(ids, lps, ranks)]
            result[request_id] = (start + 1, entries)
        return result
