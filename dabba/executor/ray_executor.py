"""Tensor-parallel ranks as Ray actors, one placement-group bundle each, on the Ray cluster this
process joins (``ray.init()``: RAY_ADDRESS or a cluster started with ``ray start`` on this host,
else a new local one). Rank 0's host holds the process group's rendezvous; the ranks that share
a host split its cores between them. Ray is an optional dependency: ``pip install ray``."""
from __future__ import annotations

import dataclasses
import os
import socket
import threading
from typing import Any

from dabba.distributed.shm_communicator import create_segment
from dabba.executor.base import RemoteExecutor, WorkerDiedError, split_cores
from dabba.executor.rank import RankPlace, Worker
from dabba.models.resolved_config import ResolvedConfig

_JOINING = threading.Lock()  # data-parallel replicas start side by side: one of them joins the cluster


class RayRank:
    """The actor: says where it runs, then builds its Worker once every rank knows the rendezvous."""

    def __init__(self) -> None:
        self.worker: Worker | None = None

    def node(self) -> tuple[str, str]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def create_segment(self, size: int) -> str:
        return create_segment(size)

    def remove_segment(self, path: str) -> None:
        os.unlink(path)

    def start(self, resolved: ResolvedConfig, place: RankPlace, local_rank: int, local_size: int, replica: int,
              replicas: int) -> None:
        """Pinned to its share of the host's cores, as if every replica placed its ranks on this
        host the way this one did (so the replicas' ranks on one host never share a core)."""
        cores = split_cores(local_size, replica, replicas)[local_rank] if resolved.device.type == "cpu" else None
        self.worker = Worker(resolved, dataclasses.replace(place, cores=cores, local_rank=local_rank))

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)


class RayExecutor(RemoteExecutor):
    def __init__(self, resolved: ResolvedConfig, size: int, replica: int = 0, replicas: int = 1) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group, remove_placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ValueError('distributed_executor_backend="ray" needs Ray: pip install ray') from None
        self.tp_size = size
        with _JOINING:
            if not ray.is_initialized():
                ray.init(log_to_driver=True)
        self._remove_group = remove_placement_group
        gpu = resolved.device.type == "cuda"
        cpus = max(1, int(ray.cluster_resources().get("CPU", size)) // (size * replicas)) if not gpu else 1
        bundle = {"CPU": cpus, **({"GPU": 1} if gpu else {})}
        self.actors: list = []
        self.broken: BaseException | None = None
        self.shm_path: str | None = None
        self.group = placement_group([bundle] * size, strategy="PACK")
        try:
            try:
                ray.get(self.group.ready(), timeout=120)
            except ray.exceptions.GetTimeoutError:
                raise ValueError(f"the Ray cluster cannot place {size} ranks of {bundle} each "
                                 f"(it has {ray.cluster_resources()})") from None
            actor = ray.remote(num_cpus=cpus, num_gpus=1 if gpu else 0)(RayRank)
            self.actors = [actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=rank)).remote() for rank in range(size)]
            nodes = self._wait([a.node.remote() for a in self.actors])
            init_method = f"tcp://{nodes[0][1]}:{self._wait([self.actors[0].free_port.remote()])[0]}"
            hosts = [node for node, _ in nodes]
            one_host = len(set(hosts)) == 1
            if one_host and resolved.device.type == "cpu" and size > 1:  # one host: shared memory, as multiproc.py
                self.shm_path = self._wait([self.actors[0].create_segment.remote(size)])[0]
            self._wait([actor.start.remote(resolved, RankPlace(rank, size, init_method, shm_path=self.shm_path),
                                           hosts[:rank].count(hosts[rank]), hosts.count(hosts[rank]), replica,
                                           replicas)
                        for rank, actor in enumerate(self.actors)])
        except BaseException:
            self.shutdown()
            raise

    def _call(self, method: str, *args: Any) -> list[Any]:
        if self.broken is not None:
            raise WorkerDiedError(f"the tensor-parallel actors stopped earlier: {self.broken}")
        return self._wait([actor.call.remote(method, *args) for actor in self.actors])

    def _wait(self, refs: list) -> list[Any]:
        """Every answer in order; the first failure (an exception, a dead actor) fails the call at
        once, as the multiprocess executor does."""
        import ray

        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except ray.exceptions.RayTaskError as e:  # the rank raised: its own exception
                self.broken = e
                self.shutdown()
                raise e.as_instanceof_cause() from None
            except ray.exceptions.RayError as e:  # the actor or its node died
                self.broken = e
                self.shutdown()
                raise WorkerDiedError(f"a tensor-parallel actor died: {e}") from None
        return ray.get(refs)

    def shutdown(self) -> None:
        import ray

        if self.shm_path is not None and self.actors:
            try:
                ray.get(self.actors[0].remove_segment.remote(self.shm_path), timeout=10)
            except ray.exceptions.RayError:
                pass  # the actor is gone; the segment stays in /dev/shm until the host reboots
            self.shm_path = None
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.group is not None:
            self._remove_group(self.group)
            self.group = None
