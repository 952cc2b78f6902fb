"""One rank, in the engine's own process: the ModelRunner called directly."""
from __future__ import annotations

from dabba.config import CacheConfig
from dabba.core.outputs import ModelRunnerOutput, SchedulerOutput
from dabba.core.spec_budget import RowBlocks
from dabba.executor.base import Executor
from dabba.models.resolved_config import ResolvedConfig
from dabba.worker.model_runner import CacheLayout, ModelRunner


class UniProcExecutor(Executor):
    def __init__(self, resolved: ResolvedConfig) -> None:
        self.runner = ModelRunner(resolved)

    def initialize_kv_cache(self, cache_config: CacheConfig, max_num_seqs: int, max_chunk: int) -> CacheLayout:
        return self.runner.initialize_kv_cache(cache_config, max_num_seqs, max_chunk)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(sched)

    def row_blocks(self) -> RowBlocks:
        return self.runner.row_blocks()
