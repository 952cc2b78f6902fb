"""This rank's place in a tensor-parallel group, and the collectives its layers call.

A model is built for one group: each layer keeps the ``TensorParallel`` that was current while it
was constructed (``building_for``, a context manager over a ContextVar, as the loader uses it) and
sizes its shard from it. Layers keep it rather than look it up per forward, so a layer always
reduces over the group it was cut for, and a model built outside any group (tests, the quantizer,
the evaluator) is a whole model with no collectives at all.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch


@dataclass(frozen=True)
class TensorParallel:
    """``rank`` of ``size``; ``communicator`` all-reduces and all-gathers over the group (None
    when size is 1, and where a model is only built to be measured: models/sizes.py)."""

    rank: int = 0
    size: int = 1
    communicator: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside [0, {self.size})")

    def split(self, total: int, what: str) -> int:
        """This rank's equal share of ``total`` (heads, channels), or a ValueError naming ``what``."""
        if total % self.size:
            raise ValueError(f"tensor_parallel_size={self.size} does not divide {what} ({total})")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (the same shape on each)."""
        return self._collective("all_reduce", x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order."""
        return self._collective("all_gather", x)

    def _collective(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.communicator is None:
            raise RuntimeError("this model was built without a communicator (to be measured), not to run")
        return getattr(self.communicator, name)(x)

SINGLE = TensorParallel()

_building: contextvars.ContextVar[TensorParallel] = contextvars.ContextVar("dabba_tensor_parallel", default=SINGLE)


@contextlib.contextmanager
def building_for(tp: TensorParallel) -> Iterator[None]:
    """Layers constructed inside take their shard of ``tp``."""
    token = _building.set(tp)
    try:
        yield
    finally:
        _building.reset(token)


def current_tensor_parallel() -> TensorParallel:
    """The group a layer under construction is cut for (SINGLE outside ``building_for``)."""
    return _building.get()


@dataclass(frozen=True)
class KVHeadShard:
    """Which KV heads a rank holds: ``num_local`` of them from ``first``. Where the group has more
    ranks than KV heads, each head is replicated on size / num_kv_heads consecutive ranks."""

    first: int
    num_local: int

    @classmethod
    def of(cls, rank: int, size: int, num_kv_heads: int) -> "KVHeadShard":
        check_kv_split(size, num_kv_heads)
        if size <= num_kv_heads:
            return cls(rank * (num_kv_heads // size), num_kv_heads // size)
        return cls(rank * num_kv_heads // size, 1)


def check_kv_split(tp_size: int, num_kv_heads: int) -> None:
    if tp_size <= num_kv_heads and num_kv_heads % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} does not divide the model's {num_kv_heads} KV heads")
    if tp_size > num_kv_heads and tp_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp_size} is more than the model's {num_kv_heads} KV heads and not a "
                         "multiple of them (each KV head is replicated on as many ranks)")


def check_split(tp_size: int, num_heads: int, num_kv_heads: int) -> None:
    """Refuse, at start-up, a split of attention heads the layers cannot make."""
    if num_heads % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} does not divide the model's {num_heads} attention heads")
    check_kv_split(tp_size, num_kv_heads)
