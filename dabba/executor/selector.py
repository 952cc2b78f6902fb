"""The choice of executor, made here once: one rank in the engine's process, more in local worker
processes, or on Ray actors where asked."""
from __future__ import annotations

from dabba.config import ParallelConfig
from dabba.distributed.tensor_parallel import check_split
from dabba.executor.base import Executor
from dabba.worker.model_runner import RunnerArgs


def make_executor(args: RunnerArgs, parallel: ParallelConfig, replica: int = 0) -> Executor:
    """One rank in this process; more in worker processes, or on Ray actors where asked. A
    data-parallel replica (``replica`` of ``parallel.data_parallel_size``) runs its ranks, even a
    single one, in worker processes on its own cores: the replicas' engine loops share the
    server's process, and their models must not share its cores."""
    size, replicas = parallel.tensor_parallel_size, parallel.data_parallel_size
    if size == 1 and replicas == 1:
        from dabba.executor.uniproc import UniProcExecutor

        return UniProcExecutor(args)
    if size > 1:
        check_split(size, args.arch.num_attention_heads, args.arch.num_key_value_heads)
    if parallel.distributed_executor_backend == "ray":
        from dabba.executor.ray_executor import RayExecutor

        return RayExecutor(args, size, replica, replicas)
    from dabba.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(args, size, replica, replicas)
