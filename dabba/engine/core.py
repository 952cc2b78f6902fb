"""The engine core (vLLM v1's EngineCore): the scheduler, the executor that runs the model, and the
grammars, stepped by one thread. Its inputs are processed requests, aborts and the stop strings
the front end finds; its outputs are EngineCoreOutputs and typed snapshots. It holds no tokenizer
of its own beyond the grammars' and never sees text."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

from dabba.core.encoder_cache import EncoderCache
from dabba.core.encoder_scheduling import EncoderScheduler
from dabba.core.kv_cache_manager import KVCacheManager, PrefixCacheView
from dabba.core.kv_offload import DiskTierIndex, HostTierIndex
from dabba.core.outputs import EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from dabba.core.request import RequestStatus
from dabba.core.scheduler import Scheduler
from dabba.core.stats import SchedulerStats
from dabba.engine.processor import EngineRequest
from dabba.engine.tokenizer import Tokenizer
from dabba.executor.selector import make_executor
from dabba.executor.uniproc import UniProcExecutor
from dabba.models.resolved_config import ResolvedConfig
from dabba.structured_output.manager import StructuredOutputManager
from dabba.worker.kv_offload import disk_tier_dir, list_blocks
from dabba.worker.model_runner import ModelRunner


def _encoder_scheduler(resolved: ResolvedConfig) -> EncoderScheduler | None:
    """A vision-language model's encoder budget and cache, its bound in embedding rows."""
    images, config = resolved.arch.images, resolved.config
    if images is None:
        return None
    row_bytes = resolved.arch.hidden_size * resolved.dtype.itemsize
    sc = config.scheduler_config
    return EncoderScheduler(sc.image_token_budget, EncoderCache(config.cache_config.encoder_cache_memory // row_bytes),
                            images.bidirectional, sc.max_num_batched_tokens, sc.image_decode_slowdown)


@dataclass(frozen=True)
class KVBlocksSnapshot:
    """The KV cache as the dashboard draws it."""

    num_blocks: int  # usable blocks (the null block is not one)
    block_size: int
    grid: str | None  # every block's state (core/block_pool.BLOCK_*), when asked for


class EngineCore:
    """One engine's scheduler, executor and grammars. Only the thread that steps it calls it:
    every method here reads or changes the scheduler's state."""

    def __init__(self, resolved: ResolvedConfig, tokenizer: Tokenizer, eos_token_ids: frozenset[int],
                 replica: int = 0) -> None:
        config = resolved.config
        cc, sc = config.cache_config, config.scheduler_config
        self.executor = make_executor(resolved, config.parallel_config, replica)
        self.cache_layout = self.executor.initialize_kv_cache(cc, sc.max_num_seqs, sc.max_num_batched_tokens)
        self.kv_cache_manager = KVCacheManager(self.cache_layout.num_blocks, cc.block_size, cc.enable_prefix_caching,
                                               self.cache_layout.groups, sc.max_num_batched_tokens,
                                               _host_tier(resolved, self.cache_layout.bytes_per_block))
        self.structured_output = StructuredOutputManager(tokenizer, resolved.arch.vocab_size, eos_token_ids)
        self.scheduler = Scheduler(sc, self.kv_cache_manager, resolved.max_model_len, self.structured_output,
                                   self.executor.row_blocks(), _encoder_scheduler(resolved),
                                   config.lora_config.max_loras if config.lora_config.enable_lora else 0)
        self.last_step_num_tokens = 0  # tokens the last step ran (the dashboard's tokens per step)
        self._step: tuple[SchedulerOutput, ModelRunnerOutput, float] | None = None  # the step not yet closed

    @property
    def model_runner(self) -> ModelRunner:
        """The in-process ModelRunner (tensor_parallel_size 1: its model, cache and layer loop)."""
        if not isinstance(self.executor, UniProcExecutor):
            raise AttributeError(f"the model runs in {self.executor.tp_size} worker processes, not in this one")
        return self.executor.runner

    def shutdown(self) -> None:
        """Stop the worker processes, if any (they also stop when the executor is collected)."""
        self.executor.shutdown()

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queue every sample of a processed prompt, or none of them (InvalidRequest if one could
        never run). A constrained prompt comes with its grammar compiled: each sample gets a matcher."""
        added = []
        try:
            for sample in request.samples:
                self.scheduler.add_request(sample)
                added.append(sample)
        except ValueError:
            for sample in added:
                self.scheduler.abort_request(sample.request_id)
            raise
        compiled = request.compilation.future.result() if request.compilation is not None else None  # done
        for sample in request.samples:
            if sample.use_structured_output:  # a grammar, or a thinking budget alone
                self.structured_output.add_request(sample.request_id, compiled, sample.sampling_params.thinking)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """Schedule, run the model, update the requests; the step stays open until finish_step()."""
        start = time.perf_counter()
        sched_out = self.scheduler.schedule()
        runner_out = self.executor.execute_model(sched_out)
        self.last_step_num_tokens = sched_out.total_num_scheduled_tokens
        self._step = (sched_out, runner_out, start)
        return self.scheduler.update_from_output(sched_out, runner_out)

    def finish_step(self, stopped: Iterable[str]) -> None:
        """Close the step: the requests whose text reached a stop string (only the front end sees
        text) finish, and the step's time, outputs processed, prices the next drafts."""
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        sched_out, runner_out, start = self._step
        self._step = None
        self.scheduler.record_step_time(sched_out, runner_out, time.perf_counter() - start)

    # ---- snapshots -----------------------------------------------------------------------
    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def prefix_cache_view(self) -> PrefixCacheView:
        """The prefix cache as a router on another thread may read it (the one such reading)."""
        return PrefixCacheView(self.kv_cache_manager)

    def kv_blocks(self, with_grid: bool) -> KVBlocksSnapshot:
        kv = self.kv_cache_manager
        return KVBlocksSnapshot(kv.num_usable_blocks, kv.block_size, kv.pool.block_states() if with_grid else None)

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset_prefix_cache: False while requests are unfinished."""
        return not self.has_unfinished_requests() and self.kv_cache_manager.reset_prefix_cache()


def _host_tier(resolved: ResolvedConfig, bytes_per_block: int) -> HostTierIndex | None:
    """The host-memory tier under the pool, --kv-offload-memory of it, and under it the disk tier
    where --kv-offload-dir names one (core/kv_offload.py), filled from what earlier runs of the
    same model left there."""
    config = resolved.config
    cc = config.cache_config
    if cc.kv_offload_memory is None:
        return None
    spec = config.scheduler_config.speculative_config
    if spec is not None and spec.method == "draft_model":
        raise ValueError("kv_offload_memory: a draft model's KV is not offloaded yet; use ngram drafts or no tier")
    if cc.kv_offload_memory < bytes_per_block:
        raise ValueError(f"kv_offload_memory={cc.kv_offload_memory} bytes is less than one KV block "
                         f"({bytes_per_block} bytes)")
    disk = None
    if cc.kv_offload_dir is not None:
        if config.parallel_config.tensor_parallel_size > 1:
            raise ValueError("kv_offload_dir: the disk tier does not take tensor-parallel ranks yet")
        if cc.kv_offload_disk_size < bytes_per_block:
            raise ValueError(f"kv_offload_disk_size={cc.kv_offload_disk_size} bytes is less than one KV block "
                             f"({bytes_per_block} bytes)")
        disk = DiskTierIndex(cc.kv_offload_disk_size // bytes_per_block, list_blocks(disk_tier_dir(resolved)))
    return HostTierIndex(cc.kv_offload_memory // bytes_per_block, bytes_per_block, disk)
