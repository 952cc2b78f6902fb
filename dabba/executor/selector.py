"""The choice of executor, made here once: one rank in the engine's process, more in local worker
processes, or on Ray actors where asked."""
from __future__ import annotations

from dabba.config import ParallelConfig
from dabba.distributed.tensor_parallel import check_split
from dabba.executor.base import Executor
from dabba.models.resolved_config import ResolvedConfig


def make_executor(resolved: ResolvedConfig, parallel: ParallelConfig, replica: int = 0) -> Executor:
    """One rank in this process; more in worker processes, or on Ray actors where asked. A
    data-parallel replica (``replica`` of ``parallel.data_parallel_size``) runs its ranks, even a
    single one, in worker processes on its own cores: the replicas' engine loops share the
    server's process, and their models must not share its cores."""
    size, replicas = parallel.tensor_parallel_size, parallel.data_parallel_size
    if size == 1 and replicas == 1:
        from dabba.executor.uniproc import UniProcExecutor

        return UniProcExecutor(resolved)
    if size > 1:
        check_split(size, resolved.arch.num_attention_heads, resolved.arch.num_key_value_heads)
    if parallel.distributed_executor_backend == "ray":
        from dabba.executor.ray_executor import RayExecutor

        return RayExecutor(resolved, size, replica, replicas)
    from dabba.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(resolved, size, replica, replicas)
