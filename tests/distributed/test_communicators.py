"""The two transports of a tensor-parallel group's collectives, in two real processes: gloo
(torch.distributed) and the shared-memory segment, on tensors that fit a slot and on tensors that
take several pieces, in float32 and bfloat16. Every rank must hold the same bits afterwards."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dabba.distributed.communicator import DistributedCommunicator
from dabba.distributed.shm_communicator import ShmCommunicator, create_segment

SLOT = 1 << 12  # bytes: small, so that the larger tensors go through in pieces


def inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(3, 5, generator=g), torch.randn(7, 333, generator=g).to(torch.bfloat16),
            torch.randn(4096, generator=g)]


def run(rank: int, store: str, shm_path: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2)
    out = {}
    for name, comm in (("gloo", DistributedCommunicator()), ("shm", ShmCommunicator(shm_path, rank, 2, SLOT))):
        out[name] = ([comm.all_reduce(x.clone()) for x in inputs(rank)],
                     [comm.all_gather(x) for x in inputs(rank)])
    results[rank] = out
    dist.destroy_process_group()


def test_all_reduce_and_all_gather_in_two_processes(tmp_path) -> None:
    shm_path = create_segment(2, SLOT)
    try:
        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(run, args=((tmp_path / "store").as_uri(), shm_path, results), nprocs=2)
            results = dict(results)
    finally:
        import os

        os.unlink(shm_path)
    a, b = inputs(0), inputs(1)
    for name in ("gloo", "shm"):
        for rank in (0, 1):
            reduced, gathered = results[rank][name]
            for x, y, r, g in zip(a, b, reduced, gathered):
                assert torch.equal(r, x + y) and r.dtype == x.dtype
                assert torch.equal(g, torch.cat([x, y], dim=-1))
        assert all(torch.equal(p, q) for p, q in zip(results[0][name][0], results[1][name][0]))
