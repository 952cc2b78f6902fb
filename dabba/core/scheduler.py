"""Continuous batching under one token budget per step (no prefill/decode phases).

Each request's ``num_computed_tokens`` catches up with its ``num_tokens``. Every step the
running requests are served first (in priority order), then waiting ones are admitted, until
``max_num_batched_tokens`` or ``max_num_seqs`` is spent. Chunked prefill, prefix hits, mixed
prefill+decode steps and resumed requests need no special case. When blocks run out, the
lowest-priority (newest) running request is preempted by recompute.

Speculative decoding plugs in as a policy (core/speculation.py), asked which drafts to verify and
how many slots a proposer writes past the step as each request is scheduled, how many tokens each
may propose once the batch is, and told what the drafts gave: what the sampler rejects is rolled
back by not counting it computed (its KV slots are overwritten next step; only known tokens are
ever hashed into the prefix cache).

Requests under structured_outputs arrive with their grammars compiled (the front end waits for
that); each step they get a row of the grammar bitmask, and their matchers advance on every token
they sample (the StructuredOutputs collaborator below). A grammar that refuses to go on ends its
request with an error (finish reason "error", Request.error says why).
"""
from __future__ import annotations

import bisect
import logging
from typing import Any, Iterable, Protocol

from dabba.config import SchedulerConfig
from dabba.core.encoder_scheduling import EncoderScheduler
from dabba.core.kv_cache_manager import KVCacheManager
from dabba.core.lora_slots import AdaptersInUse
from dabba.core.outputs import (CachedRequestData, EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput,
                                NewRequestData, SchedulerOutput)
from dabba.core.pooling_budget import PoolingBudget, decoding, step_mix
from dabba.core.request import Request, RequestStatus
from dabba.core.spec_budget import RowBlocks
from dabba.core.speculation import make_speculation
from dabba.core.stats import SchedulerStats
from dabba.core.step_shares import StepShares
from dabba.errors import InvalidRequest

logger = logging.getLogger("dabba")


class StructuredOutputs(Protocol):
    """What the scheduler asks of the structured-output manager (structured_output/manager.py),
    which holds the per-request matchers."""

    def grammar_bitmask(self, request_ids: list[str]) -> Any: ...

    def accept_token(self, request_id: str, token_id: int) -> bool: ...  # True: ended; ValueError: cannot go on

    def free(self, request_id: str) -> None: ...


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, max_model_len: int,
                 structured_output: StructuredOutputs | None = None, row_blocks: RowBlocks = RowBlocks(),
                 encoder: EncoderScheduler | None = None, max_loras: int = 0) -> None:
        self.config = config
        self.max_loras = max_loras  # LoRA adapters the running requests may use at once (core/lora_slots.py)
        self.encoder = encoder  # a model that reads images: which of them each step encodes
        self.structured_output = structured_output
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []  # sorted by Request.sort_key: the last is the first victim
        self.finished_req_ids: set[str] = set()  # to tell the worker next step
        self.num_preemptions = 0
        # speculative decoding's policy: ``row_blocks``, how the worker's kernels group rows, prices drafts
        self.speculation = make_speculation(config.speculative_config, max_model_len, row_blocks)
        # pooling requests' share of a step while generation requests decode (None: no limit)
        slowdown = config.pooling_decode_slowdown
        self.pooling_budget = PoolingBudget(slowdown) if slowdown > 1.0 else None
        self.num_pooling_requests = 0  # unfinished: the share is kept (and steps timed) only while there are some
        self._step_mix: tuple[int, int, int] | None = None  # the last step's decode rows, pooling tokens, prompt tokens

    # ---- admission -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request, or raise InvalidRequest if it could never run to completion."""
        if request.request_id in self.requests:
            raise InvalidRequest("request_id", f"request_id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise InvalidRequest("prompt", "prompt must contain at least one token")
        pooling = request.pooling_params is not None
        need = request.num_prompt_tokens + (0 if pooling else request.max_tokens)
        if need > self.max_model_len:
            raise InvalidRequest("prompt", (
                f"input ({request.num_prompt_tokens} tokens) exceeds max_model_len ({self.max_model_len}); shorten "
                "it or set truncate_prompt_tokens" if pooling else
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.max_tokens}) = {need} "
                f"exceeds max_model_len ({self.max_model_len}); shorten the prompt or lower max_tokens"))
        # The last sampled token is never fed back, so it never needs a KV slot (a pooled input's all do).
        num_blocks = self.kv_cache_manager.blocks_needed(need if pooling else need - 1)
        if num_blocks > self.kv_cache_manager.num_usable_blocks:
            raise InvalidRequest(
                None,
                f"request needs {num_blocks} KV blocks but the cache has only "
                f"{self.kv_cache_manager.num_usable_blocks}; raise kv_cache_memory or lower max_tokens"
            )
        if request.one_step_prompt and request.num_prompt_tokens > self.config.max_num_batched_tokens:
            raise InvalidRequest("prompt", f"input ({request.num_prompt_tokens} tokens) exceeds max_num_batched_tokens "
                                           f"({self.config.max_num_batched_tokens}), and an encoder's input runs in one "
                                           "step; raise max_num_batched_tokens")
        if request.mm_features:
            if self.encoder is None:
                raise InvalidRequest("multi_modal_data", "this model takes no images")
            self.encoder.check(request)
        if request.use_structured_output and self.structured_output is None:
            raise InvalidRequest("structured_outputs", "structured_outputs needs an engine with a structured-output backend")
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=Request.sort_key)
        if request.pooling_params is not None:
            if self.num_pooling_requests == 0 and self.pooling_budget is not None:
                self.pooling_budget.restart()
            self.num_pooling_requests += 1

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None or request.status.is_finished:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        budget = self.config.max_num_batched_tokens
        kv = self.kv_cache_manager
        preempted = False
        rationed = self.pooling_budget is not None and self.num_pooling_requests > 0
        shares = StepShares()  # what rationed work may take this step
        if rationed and any(r.pooling_params is None and decoding(r) for r in self.running):
            shares.pooling = self.pooling_budget.tokens()
        if self.encoder is not None:
            shares.image = self.encoder.begin_step(out, self.running, self.waiting)
            out.encoder_work = self.encoder.work
            out.free_encoder_hashes = self.encoder.cache.take_evicted()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            num_new = shares.limit(request, num_new)
            if num_new == 0:
                i += 1
                continue
            encode = None
            if request.mm_features:
                num_new, encode = self.encoder.fit(request, request.num_computed_tokens, num_new)
                if num_new == 0:  # its next image waits for its encoding, or the encoder's budget or room
                    i += 1
                    continue
            drafts = self.speculation.drafts(request, num_new, budget)
            num_new += len(drafts)
            lookahead = self.speculation.lookahead(request, request.num_computed_tokens + num_new)
            new_blocks = kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
            while new_blocks is None:
                victim = self.running[-1]
                self._preempt(victim)
                out.finished_req_ids.add(victim.request_id)
                preempted = True
                if victim is request:
                    break
                new_blocks = kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
            if new_blocks is None:
                break
            if encode is not None:
                self.encoder.schedule(out, request, encode, request.num_computed_tokens, num_new)
            out.scheduled_cached_reqs.append(CachedRequestData(
                request.request_id, tuple([b.block_id for b in blocks] for blocks in new_blocks),
                request.num_computed_tokens))
            out.num_scheduled_tokens[request.request_id] = num_new
            if drafts:
                out.scheduled_spec_decode_tokens[request.request_id] = drafts
            budget -= num_new
            shares.take(request, num_new)
            i += 1

        # Admit waiting requests, unless this step already had to preempt (memory is tight); past
        # pooling requests when their share of the step is spent.
        adapters = AdaptersInUse(self.max_loras, self.running)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            j = next((k for k, r in enumerate(self.waiting)  # (one whose prefix comes from disk waits for it)
                      if shares.limit(r, 1) and adapters.admits(r) and not kv.fetching(r)), -1)
            if j < 0:
                break
            request = self.waiting[j]
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            num_new = shares.limit(request, min(request.num_tokens - num_hit, budget))
            if request.one_step_prompt and num_new < request.num_tokens - num_hit:
                break  # whole, in a later step
            encode = None
            if request.mm_features:
                num_new, encode = self.encoder.fit(request, num_hit, num_new)
                if num_new == 0:
                    break  # its next image waits for its encoding, or the encoder's budget or room
            lookahead = self.speculation.lookahead(request, num_hit + num_new)
            if kv.allocate_slots(request, num_new, hit_blocks, lookahead) is None:
                break
            self.waiting.pop(j)
            if encode is not None:
                self.encoder.schedule(out, request, encode, num_hit, num_new)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=Request.sort_key)
            adapters.add(request)
            out.scheduled_new_reqs.append(NewRequestData.of(request, kv.get_block_ids(request.request_id), num_hit))
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
            shares.take(request, num_new)

        if self.encoder is not None:
            self.encoder.end_step(out.num_scheduled_tokens, self.requests)
        self._step_mix = step_mix(out.num_scheduled_tokens, self.requests) if rationed else None
        self._add_grammar_bitmask(out)
        out.total_num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        self.speculation.budget_drafts(out, self.requests)
        out.kv_transfers = self.kv_cache_manager.take_transfers()
        return out

    def record_step_time(self, out: SchedulerOutput, runner_out: ModelRunnerOutput, seconds: float) -> None:
        """The time a step took, from schedule() to its outputs (the engine measures it), for the
        speculation policy's cost model and the pooling requests' share of a step."""
        self.speculation.record_step(out, runner_out, seconds)
        if self.pooling_budget is not None and self._step_mix is not None:
            self.pooling_budget.record(*self._step_mix, seconds)
        if self.encoder is not None:
            self.encoder.record(runner_out, seconds)

    def _add_grammar_bitmask(self, out: SchedulerOutput) -> None:
        """A row for each constrained request that samples this step: one whose scheduled tokens
        reach the end of its known tokens (num_computed_tokens is still this step's start)."""
        ids = [request_id for request_id, num_new in out.num_scheduled_tokens.items()
               if (request := self.requests[request_id]).use_structured_output
               and request.num_computed_tokens + num_new >= request.num_tokens]
        if ids:
            out.structured_output_request_ids = ids
            out.grammar_bitmask = self.structured_output.grammar_bitmask(ids)

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop its KV; it waits again with its output kept."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        if request.mm_features:
            self.encoder.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=Request.sort_key)

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> EngineCoreOutputs:
        """Advance progress, append sampled tokens, finish requests. Returns what is new for each
        request this step (the engine's only view of the requests)."""
        outputs = EngineCoreOutputs()
        self.kv_cache_manager.fetched(runner_out.kv_fetched, runner_out.kv_fetch_failed)
        if self.encoder is not None:
            self.encoder.encoded(runner_out.encoded_images)
        for request_id, num_tokens in sched_out.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None:  # aborted while the step ran
                continue
            prompt_logprobs = runner_out.prompt_logprobs.get(request_id)
            token_ids = runner_out.sampled_token_ids.get(request_id)
            drafts = sched_out.scheduled_spec_decode_tokens.get(request_id, ())
            # Drafts after the first one the sampler disagreed with are not computed: their KV
            # slots are written over next step.
            num_rejected = len(drafts) - (len(token_ids) - 1) if drafts and token_ids else 0
            request.num_computed_tokens += num_tokens - num_rejected
            if request.mm_features:
                self.encoder.advance(request)
            if drafts:
                self.speculation.verified(request, len(drafts), num_rejected)
            pooled = runner_out.pooler_output.get(request_id)
            if pooled is not None:  # its whole input went through: the embedding ends it
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                outputs.outputs.append(EngineCoreOutput(request_id, [], "stop", pooling_output=pooled,
                                                        num_cached_tokens=request.num_cached_tokens))
                continue
            if token_ids is None:  # a prefill chunk that has not reached the end of the prompt
                if prompt_logprobs is not None:
                    outputs.outputs.append(EngineCoreOutput(request_id, [], new_prompt_logprobs=prompt_logprobs,
                                                            num_cached_tokens=request.num_cached_tokens))
                continue
            new_token_ids, status = [], None
            for token_id in token_ids:  # a stop inside an accepted run cuts it where a plain run stops
                request.append_output_token(token_id)
                new_token_ids.append(token_id)
                status = self._check_stop(request, token_id)
                if request.use_structured_output:
                    status = self._advance_grammar(request, token_id, status)
                if status is not None:
                    break
            if status == RequestStatus.FINISHED_ERROR:  # its grammar's dead end picked the token, not the model
                new_token_ids.pop()
            if status is not None:
                self._finish(request, status)
            else:
                request.spec_token_ids = runner_out.spec_token_ids.get(request_id, [])
            logprobs = runner_out.logprobs.get(request_id)
            outputs.outputs.append(EngineCoreOutput(
                request_id=request_id,
                new_token_ids=new_token_ids,
                finish_reason=request.status.finish_reason,
                stop_reason=request.stop_reason,
                error=request.error,
                new_logprobs=logprobs[:len(new_token_ids)] if logprobs is not None else None,
                new_prompt_logprobs=prompt_logprobs,
                num_cached_tokens=request.num_cached_tokens,
            ))
        return outputs

    def _advance_grammar(self, request: Request, token_id: int, status: RequestStatus | None) -> RequestStatus | None:
        """The grammar's end stops the request (whatever min_tokens or ignore_eos say: nothing
        may follow it); a grammar that cannot go on (a dead end) ends it with an error."""
        try:
            ended = self.structured_output.accept_token(request.request_id, token_id)
        except ValueError as e:
            logger.warning("request %s ended: %s", request.request_id, e)
            request.error = str(e)
            return RequestStatus.FINISHED_ERROR
        return status or (RequestStatus.FINISHED_STOPPED if ended else None)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if request.num_output_tokens <= params.min_tokens:
            return None  # stop tokens do not count before min_tokens (the sampler bans them too)
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        return None

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish from outside the step (the engine found a stop string in the text); ids that
        already finished (the same token reached max_tokens, or eos) are skipped."""
        for request_id in request_ids:
            request = self.requests.get(request_id)  # only unfinished requests are kept
            if request is not None:
                self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv_cache_manager.free(request)
        if request.mm_features:  # (add_request refused images where no encoder reads them)
            self.encoder.free(request)
        if request.use_structured_output:
            self.structured_output.free(request.request_id)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        if request.pooling_params is not None:
            self.num_pooling_requests -= 1

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        used = kv.num_usable_blocks - kv.pool.num_free_blocks
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_hit_rate=kv.prefix_stats.hit_rate,
            num_preemptions=self.num_preemptions,
            kv_blocks_total=kv.num_usable_blocks,
            kv_blocks_used=used,
            kv_slots_allocated=used * kv.block_size,
            kv_tokens_stored=kv.filled_slots({r.request_id: r.num_computed_tokens for r in self.running}),
            prefix_cache_hit_tokens=kv.prefix_stats.num_hit_tokens,
            prefix_cache_queried_tokens=kv.prefix_stats.num_queried_tokens,
            spec_num_drafts=self.speculation.counters.num_drafts,
            spec_num_draft_tokens=self.speculation.counters.num_draft_tokens,
            spec_num_accepted_tokens=self.speculation.counters.num_accepted_tokens,
            num_images_encoded=self.encoder.num_encoded if self.encoder is not None else 0,
            **kv.offload_stats(),
        )

