"""One tensor-parallel rank: its cores, its place in the process group, its ModelRunner. The same
class runs in a local worker process (multiproc.py's loop below) and as a Ray actor."""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from dabba.config import CacheConfig
from dabba.core.outputs import ModelRunnerOutput, SchedulerOutput
from dabba.core.spec_budget import RowBlocks
from dabba.distributed.communicator import DistributedCommunicator
from dabba.distributed.shm_communicator import ShmCommunicator
from dabba.distributed.tensor_parallel import TensorParallel
from dabba.models.resolved_config import ResolvedConfig
from dabba.worker.model_runner import CacheLayout, ModelRunner

logger = logging.getLogger("dabba")

# How long a collective may wait for a rank before it fails (gloo's and NCCL's timeout): a rank
# that died leaves the others blocked in their next all-reduce until then.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class RankPlace:
    """Where rank ``rank`` of ``size`` runs: the process group's rendezvous (``init_method``,
    a file:// or tcp:// URL), the cores its threads are pinned to (None: leave them), and the
    shared-memory segment of a group on one host (None: the group spans hosts or GPUs)."""

    rank: int
    size: int
    init_method: str
    cores: tuple[int, ...] | None = None
    local_rank: int = 0  # among the ranks on its host: its GPU
    shm_path: str | None = None


def make_communicator(place: RankPlace) -> DistributedCommunicator | ShmCommunicator:
    """The one place that picks a group's collectives: shared memory between CPU ranks of one
    host (microseconds where gloo takes a millisecond: benchmarks/tp_comm.py), else
    torch.distributed's backend (gloo across hosts, NCCL between GPUs)."""
    if place.shm_path is not None:
        return ShmCommunicator(place.shm_path, place.rank, place.size)
    return DistributedCommunicator()


class Worker:
    def __init__(self, resolved: ResolvedConfig, place: RankPlace) -> None:
        if place.cores:
            os.sched_setaffinity(0, place.cores)
            torch.set_num_threads(len(place.cores))
        if resolved.device.type == "cuda":
            resolved = dataclasses.replace(resolved, device=torch.device("cuda", place.local_rank))
            torch.cuda.set_device(resolved.device)
        dist.init_process_group("nccl" if resolved.device.type == "cuda" else "gloo", init_method=place.init_method,
                                rank=place.rank, world_size=place.size, timeout=COLLECTIVE_TIMEOUT)
        self.place = place
        self.runner = ModelRunner(resolved, TensorParallel(place.rank, place.size, make_communicator(place)))

    def initialize_kv_cache(self, cache_config: CacheConfig, max_num_seqs: int, max_chunk: int) -> CacheLayout:
        return self.runner.initialize_kv_cache(cache_config, max_num_seqs, max_chunk)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """Rank 0's output travels back; the others' (the same) would only cost the pickling."""
        out = self.runner.execute_model(sched)
        return out if self.place.rank == 0 else None

    def row_blocks(self) -> RowBlocks:
        return self.runner.row_blocks()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def worker_main(conn: Connection) -> None:
    """A local worker process: receive (ResolvedConfig, RankPlace), build the rank, then answer the
    engine's calls, one (method, args) at a time, with (True, result) or (False, the exception),
    until "shutdown" or the engine's end of the pipe closes."""
    resolved, place = conn.recv()
    if place.rank:  # rank 0 says what every rank would
        logger.setLevel(logging.WARNING)
    try:
        worker = Worker(resolved, place)
    except BaseException as e:
        conn.send((False, _portable(e)))
        return
    conn.send((True, None))
    while True:
        try:
            method, call_args = conn.recv()
        except EOFError:  # the engine is gone
            break
        if method == "shutdown":
            break
        try:
            conn.send((True, getattr(worker, method)(*call_args)))
        except BaseException as e:
            conn.send((False, _portable(e)))
    worker.shutdown()


def _portable(e: BaseException) -> BaseException:
    """The exception itself where it pickles (a ValueError keeps its type for the caller), else a
    RuntimeError carrying its traceback."""
    import pickle

    try:
        pickle.dumps(e)
        return e
    except Exception:
        return RuntimeError("".join(traceback.format_exception(e)))




if __name__ == "__main__":  # python -m dabba.executor.rank FD: multiproc.py starts it so
    import sys

    worker_main(Connection(int(sys.argv[1])))
