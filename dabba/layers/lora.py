"""LoRA inside a linear layer: the adapters resident in a layer's slots, and the step's rows of
each adapter, so that one batch mixes adapters and the base model: the base product runs once
for every row, then each adapter's rows add x A^T B^T (scaled), Punica's shrink and expand
segment by segment (SGMV), here in PyTorch, the reference.

A merged layer (q, k, v; gate, up) holds each shard's ranks side by side in A and puts each
shard's B in its own rows (B is block-diagonal), so one shrink and one expand serve every shard
and a shard the adapter leaves alone contributes zeros."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch

# the step's (slot, rows of the flat batch) per adapter in use; None: every row is the base model's
StepRows = list[tuple[int, torch.Tensor]]
_step_rows: contextvars.ContextVar[StepRows | None] = contextvars.ContextVar("dabba_lora_rows", default=None)


@contextlib.contextmanager
def lora_rows(rows: StepRows | None) -> Iterator[None]:
    """The adapters' rows while a step's layers run (the model runner sets them)."""
    token = _step_rows.set(rows or None)
    try:
        yield
    finally:
        _step_rows.reset(token)


class LoRASlots:
    """One linear layer's resident adapters: A [slots, shards * max_rank, in] and B [slots, out,
    shards * max_rank], scaling folded into B; an empty slot is zeros."""

    def __init__(self, in_features: int, output_sizes: list[int], slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.output_sizes, self.max_rank = list(output_sizes), max_rank
        ranks = len(output_sizes) * max_rank
        self.a = torch.zeros(slots, ranks, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(slots, sum(output_sizes), ranks, dtype=dtype, device=device)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def set_shard(self, slot: int, shard: int, a: torch.Tensor, b: torch.Tensor, scaling: float, name: str) -> None:
        """Shard ``shard``'s A [rank, in] and B [out of that shard, rank] into ``slot``."""
        rank, rows = a.shape[0], self.output_sizes[shard]
        if a.shape[1] != self.a.shape[2] or b.shape != (rows, rank):
            raise ValueError(f"{name}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit a layer of "
                             f"{self.a.shape[2]} inputs and {rows} outputs")
        ranks = slice(shard * self.max_rank, shard * self.max_rank + rank)
        start = sum(self.output_sizes[:shard])
        self.a[slot, ranks] = a.to(self.a.dtype)
        self.b[slot, start:start + rows, ranks] = (b.float() * scaling).to(self.b.dtype)

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y += each step row's adapter product (y: the base output of x; unchanged without adapters)."""
        rows = _step_rows.get()
        if rows is None:
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for slot, index in rows:
            shrunk = x2[index] @ self.a[slot].T  # [rows, ranks]
            y2.index_add_(0, index, (shrunk @ self.b[slot].T).to(y2.dtype))
        return y


def step_has_adapters() -> bool:
    return _step_rows.get() is not None
