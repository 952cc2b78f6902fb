"""LoRA inside a linear layer: the adapters resident in a layer's slots, and the step's rows of
each adapter, so that one batch mixes adapters and the base model: the base product runs once
for every row, then each adapter's rows add x A^T B^T (scaled), Punica's shrink and expand
segment by segment (SGMV): csrc/lora_cpu.cpp on the CPU, the PyTorch loop below everywhere
else and as the reference; add_lora chooses.

A merged layer (q, k, v; gate, up) holds each shard's ranks side by side in A and puts each
shard's B in its own rows (B is block-diagonal), so one shrink and one expand serve every shard
and a shard the adapter leaves alone contributes zeros."""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator

import torch

from dabba.ops import native


@dataclass
class StepRows:
    """The step's rows of each adapter in use: per slot its rows of the flat batch (the reference's
    segments), and the same flat, a slot per row (the native kernel's)."""

    segments: list[tuple[int, torch.Tensor]]
    rows: torch.Tensor  # [n] int64
    slots: torch.Tensor  # [n] int64

    @classmethod
    def of(cls, segments: list[tuple[int, torch.Tensor]]) -> "StepRows":
        rows = torch.cat([index for _, index in segments])
        slots = torch.cat([torch.full_like(index, slot) for slot, index in segments])
        return cls(segments, rows, slots)


_step_rows: contextvars.ContextVar[StepRows | None] = contextvars.ContextVar("dabba_lora_rows", default=None)


@contextlib.contextmanager
def lora_rows(rows: StepRows | None) -> Iterator[None]:
    """The adapters' rows while a step's layers run (the model runner sets them)."""
    token = _step_rows.set(rows)
    try:
        yield
    finally:
        _step_rows.reset(token)


class LoRASlots:
    """One linear layer's resident adapters: A [slots, shards * max_rank, in] and B transposed,
    Bt [slots, shards * max_rank, out], scaling folded into B; an empty slot is zeros."""

    def __init__(self, in_features: int, output_sizes: list[int], slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.output_sizes, self.max_rank = list(output_sizes), max_rank
        ranks = len(output_sizes) * max_rank
        self.a = torch.zeros(slots, ranks, in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(slots, ranks, sum(output_sizes), dtype=dtype, device=device)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.bt[slot].zero_()

    def set_shard(self, slot: int, shard: int, a: torch.Tensor, b: torch.Tensor, scaling: float, name: str) -> None:
        """Shard ``shard``'s A [rank, in] and B [out of that shard, rank] into ``slot``."""
        rank, rows = a.shape[0], self.output_sizes[shard]
        if a.shape[1] != self.a.shape[2] or b.shape != (rows, rank):
            raise ValueError(f"{name}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit a layer of "
                             f"{self.a.shape[2]} inputs and {rows} outputs")
        ranks = slice(shard * self.max_rank, shard * self.max_rank + rank)
        start = sum(self.output_sizes[:shard])
        self.a[slot, ranks] = a.to(self.a.dtype)
        self.bt[slot, ranks, start:start + rows] = (b.float() * scaling).to(self.bt.dtype).T

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y += each step row's adapter product (y: the base output of x; unchanged without adapters)."""
        rows = _step_rows.get()
        if rows is not None:
            add_lora(y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]), self.a, self.bt, rows)
        return y


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, rows: StepRows) -> None:
    """The one place the kernel is chosen: the native one on the CPU (float32 or bf16 throughout,
    rows contiguous), else the reference."""
    if (native.use_cpu_kernels(x) and x.dtype in (torch.float32, torch.bfloat16) and y.dtype == a.dtype == x.dtype
            and x.stride(-1) == 1 and y.stride(-1) == 1):
        torch.ops.dabba_cpu.lora_add(y, x, a, bt, rows.rows, rows.slots)
        return
    add_lora_reference(y, x, a, bt, rows)


def add_lora_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, rows: StepRows) -> None:
    for slot, index in rows.segments:
        shrunk = x[index] @ a[slot].T  # [rows, ranks]
        y.index_add_(0, index, (shrunk @ bt[slot]).to(y.dtype))


def step_has_adapters() -> bool:
    return _step_rows.get() is not None
