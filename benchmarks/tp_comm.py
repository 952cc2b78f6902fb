"""What tensor parallelism's communication costs a decode step, per transport: the collectives of
one step of a model shape (an all-reduce of the embedded tokens, two per layer, and the gather of
the vocabulary-parallel logits) between local ranks, each a process pinned to its own core with
one thread, as the multiprocess executor places them. Prints JSON, a line per (shape, rows,
transport).

    python -m benchmarks.tp_comm [--shapes smollm2-135m,qwen2.5-1.5b] [--tp 2] [--rows 1,16] [--steps 50]

gloo is torch.distributed's CPU backend (what crosses hosts); shm is the shared-memory segment
(dabba/distributed/shm_communicator.py) the executors use between ranks of one host. Compare
us_per_step with a step's compute at tp=1 (benchmarks/layer_loop.py, dabba bench) to see which
side of a step communication is on.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dabba.distributed.communicator import DistributedCommunicator
from dabba.distributed.shm_communicator import ShmCommunicator, create_segment

# hidden size, decoder layers, vocabulary (the models' config.json)
SHAPES = {"smollm2-135m": (576, 30, 49152), "qwen2.5-1.5b": (1536, 28, 151936), "llama-3.1-70b": (8192, 80, 128256)}


def one_step(comm, hidden: torch.Tensor, logits: torch.Tensor, layers: int) -> None:
    comm.all_reduce(hidden)  # the vocabulary-parallel embedding
    for _ in range(2 * layers):  # o_proj and down_proj
        comm.all_reduce(hidden)
    comm.all_gather(logits)


def rank_main(rank: int, size: int, store: str, shm_path: str, cases: list[tuple], steps: int, results) -> None:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=size)
    comms = {"gloo": DistributedCommunicator(), "shm": ShmCommunicator(shm_path, rank, size)}
    for shape, rows in cases:
        hidden_size, layers, vocab = SHAPES[shape]
        hidden = torch.randn(rows, hidden_size, dtype=torch.bfloat16)
        logits = torch.randn(rows, vocab // size, dtype=torch.bfloat16)
        for transport, comm in comms.items():
            one_step(comm, hidden, logits, layers)  # warm
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                one_step(comm, hidden, logits, layers)
            elapsed = (time.perf_counter() - start) / steps
            if rank == 0:
                results.append({"shape": shape, "tp": size, "rows": rows, "transport": transport,
                                "all_reduces_per_step": 2 * layers + 1,
                                "all_reduce_bytes": rows * hidden_size * 2,
                                "gather_bytes_per_rank": rows * (vocab // size) * 2,
                                "us_per_step": round(elapsed * 1e6, 1)})
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="smollm2-135m,qwen2.5-1.5b", help=f"of {sorted(SHAPES)}")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rows", default="1,16", help="tokens a step (decode: the batch)")
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()
    cases = [(shape, int(rows)) for shape in args.shapes.split(",") for rows in args.rows.split(",")]
    shm_path = create_segment(args.tp)
    try:
        with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
            results = manager.list()
            mp.spawn(rank_main, args=(args.tp, (Path(tmp) / "store").as_uri(), shm_path, cases, args.steps, results),
                     nprocs=args.tp)
            for row in results:
                print(json.dumps(row))
    finally:
        os.unlink(shm_path)


if __name__ == "__main__":
    main()
