"""The choice of executor, made here once: one rank in the engine's process, more in local worker
processes, or on Ray actors where asked."""
from __future__ import annotations

from dabba.config import ParallelConfig
from dabba.distributed.tensor_parallel import check_split
from dabba.executor.base import Executor
from dabba.worker.model_runner import RunnerArgs


def make_executor(args: RunnerArgs, parallel: ParallelConfig) -> Executor:
    """One rank in this process; more in worker processes, or on Ray actors where asked."""
    size = parallel.tensor_parallel_size
    if size == 1:
        from dabba.executor.uniproc import UniProcExecutor

        return UniProcExecutor(args)
    check_split(size, args.arch.num_attention_heads, args.arch.num_key_value_heads)
    if parallel.distributed_executor_backend == "ray":
        from dabba.executor.ray_executor import RayExecutor

        return RayExecutor(args, size)
    from dabba.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(args, size)
