"""The collectives a tensor-parallel rank's layers call, over torch.distributed's default group:
gloo between CPU processes (on one host or across hosts), NCCL between GPUs."""
from __future__ import annotations

import torch
import torch.distributed as dist


class DistributedCommunicator:
    """torch.distributed's all-reduce and all-gather on the process group every rank joined."""

    def __init__(self) -> None:
        self.world_size = dist.get_world_size()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x)  # in place: x is a layer's fresh output
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)
