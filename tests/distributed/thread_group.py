"""Tensor parallelism inside one test process: each rank a thread with its own ModelRunner, the
collectives a barrier over shared slots. The layers, loaders and runners are the real ones; only
the transport differs from the process executors (which tests run for the features that need them),
so every family's sharding is checked in a second or two instead of two interpreters' start-up."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from dabba.config import CacheConfig
from dabba.core.outputs import ModelRunnerOutput, SchedulerOutput
from dabba.core.spec_budget import RowBlocks
from dabba.distributed.tensor_parallel import TensorParallel
from dabba.executor.base import Executor
from dabba.models.resolved_config import ResolvedConfig
from dabba.worker.model_runner import CacheLayout, ModelRunner


class ThreadGroup:
    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: list[Any] = [None] * size
        self.calls = 0  # collectives rank 0 took part in


class ThreadCommunicator:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank = group, rank

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        g = self.group
        g.slots[self.rank] = x
        g.barrier.wait()
        parts = list(g.slots)
        g.barrier.wait()  # nobody overwrites a slot before everyone has read it
        if self.rank == 0:
            g.calls += 1
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(x.contiguous()), dim=-1)


class ThreadExecutor(Executor):
    def __init__(self, resolved: ResolvedConfig, size: int) -> None:
        self.tp_size = size
        self.group = ThreadGroup(size)
        self.runners = [ModelRunner(resolved, TensorParallel(r, size, ThreadCommunicator(self.group, r)))
                        for r in range(size)]
        self.pool = ThreadPoolExecutor(size)

    def _all(self, fn: Callable[[ModelRunner], Any]) -> list[Any]:
        return [f.result() for f in [self.pool.submit(fn, runner) for runner in self.runners]]

    def initialize_kv_cache(self, cache_config: CacheConfig, max_num_seqs: int, max_chunk: int) -> CacheLayout:
        layouts = self._all(lambda r: r.initialize_kv_cache(cache_config, max_num_seqs, max_chunk))
        assert all(layout == layouts[0] for layout in layouts)
        return layouts[0]

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        outs = self._all(lambda r: r.execute_model(sched))
        for out in outs[1:]:  # every rank samples the same tokens from the same gathered logits
            assert (out.sampled_token_ids, out.spec_token_ids) == (outs[0].sampled_token_ids, outs[0].spec_token_ids)
        return outs[0]

    def row_blocks(self) -> RowBlocks:
        return self.runners[0].row_blocks()

    def shutdown(self) -> None:
        self.pool.shutdown()
