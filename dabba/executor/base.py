"""The executor interface the engine calls (selector.py picks the executor)."""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any

from dabba.config import CacheConfig
from dabba.core.outputs import ModelRunnerOutput, SchedulerOutput
from dabba.core.spec_budget import RowBlocks
from dabba.worker.model_runner import CacheLayout


class WorkerDiedError(RuntimeError):
    """A rank's process or actor is gone: its group is broken, and the engine with it."""


class Executor(ABC):
    """Runs every rank's ModelRunner; the answers are rank 0's (all ranks compute the same)."""

    tp_size: int = 1

    @abstractmethod
    def initialize_kv_cache(self, cache_config: CacheConfig, max_num_seqs: int, max_chunk: int) -> CacheLayout:
        ...

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        ...

    @abstractmethod
    def row_blocks(self) -> RowBlocks:
        ...

    def shutdown(self) -> None:
        """Stop the workers (an in-process runner has none)."""


class RemoteExecutor(Executor):
    """Ranks elsewhere (processes, actors): every call goes to all of them, and rank 0 answers."""

    def initialize_kv_cache(self, cache_config: CacheConfig, max_num_seqs: int, max_chunk: int) -> CacheLayout:
        return self._call("initialize_kv_cache", cache_config, max_num_seqs, max_chunk)[0]

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self._call("execute_model", sched)[0]

    def row_blocks(self) -> RowBlocks:
        return self._call("row_blocks")[0]

    @abstractmethod
    def _call(self, method: str, *args: Any) -> list[Any]:
        """Worker.``method``(*args) on every rank; the answers in rank order."""


def split_cores(size: int, replica: int = 0, replicas: int = 1) -> list[tuple[int, ...]]:
    """The cores of replica ``replica``'s ``size`` local ranks: this process's cores split in equal
    shares among every rank of the ``replicas`` replicas (the rest, if they do not divide, stay
    idle rather than be shared)."""
    cores = sorted(os.sched_getaffinity(0))
    ranks = size * replicas
    if ranks > len(cores):
        what = (f"tensor_parallel_size={size}" if replicas == 1 else
                f"data_parallel_size={replicas} x tensor_parallel_size={size} = {ranks} ranks")
        raise ValueError(f"{what} is more than the {len(cores)} cores this process may use: "
                         "each rank needs a core of its own")
    per_rank = len(cores) // ranks
    first = replica * size
    return [tuple(cores[r * per_rank:(r + 1) * per_rank]) for r in range(first, first + size)]
