"""All-reduce and all-gather through shared memory, for ranks on one host.

gloo takes milliseconds to all-reduce one token's hidden state between two local processes (its
TCP transport and its own threads); a decode step all-reduces twice a layer, so that alone would
cost more than the step's compute (benchmarks/tp_comm.py measures both transports). Here each rank copies its tensor into
its slot of one shared segment, publishes a sequence number, waits until every rank has published
the same one, and reads all slots: the sum is taken in rank order on every rank, so all ranks hold
the same bits (the sampler then draws the same tokens on each).

The segment is a file in /dev/shm (memory, not disk), mapped by every rank; the executor creates
it and removes it. Layout (``segment_size(size, slot_bytes)`` bytes)::

    | flags: size x FLAG_STRIDE bytes | buffer 0: size slots of slot_bytes | buffer 1: the same |

Rank r's flag is the number of its last collective, and the number of its next one is read from
there: the native layer loop's collectives (csrc/shm_group.h, the same protocol in C++) take turns
with these on one segment without a counter to share. Collective n uses buffer n % 2: a rank writes
buffer n % 2 again only at n + 2, after every rank published n + 1, which each did only once it had
read collective n. Tensors larger than a slot go through in slot-sized pieces, one collective each.
The flags are 8-byte aligned int64 stores and loads, ordered as x86 orders stores (TSO).
"""
from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import torch

FLAG_STRIDE = 64  # one cache line per rank's flag: no false sharing between the spinning ranks
DEFAULT_SLOT_BYTES = 4 * 2**20
SPIN_BEFORE_SLEEP = 2_000  # flag reads (about 1 us each) before the waiting rank starts to yield its core
TIMEOUT_S = 300.0  # as the gloo group's: a rank that never arrives has died (its executor stops the others)


def segment_size(size: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> int:
    return size * FLAG_STRIDE + 2 * size * slot_bytes


def create_segment(size: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> str:
    """A zeroed segment for ``size`` ranks: its path (the caller removes it)."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="dabba-tp-", dir=directory)
    with os.fdopen(fd, "wb") as f:
        f.truncate(segment_size(size, slot_bytes))
    return path


class ShmCommunicator:
    """Rank ``rank`` of ``size`` on the segment at ``path`` (create_segment)."""

    def __init__(self, path: str, rank: int, size: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> None:
        self.path, self.rank, self.size, self.slot_bytes = path, rank, size, slot_bytes
        segment = torch.from_file(path, shared=True, size=segment_size(size, slot_bytes), dtype=torch.uint8)
        self.flags = segment[:size * FLAG_STRIDE].numpy().view(np.int64)[::FLAG_STRIDE // 8]  # [size]
        base = size * FLAG_STRIDE
        self.slots = [[segment[base + (b * size + r) * slot_bytes:base + (b * size + r + 1) * slot_bytes]
                       for r in range(size)] for b in range(2)]

    def native_group_args(self) -> tuple:
        """NativeDecoder.set_group's arguments: this segment, this rank, and the protocol's values."""
        return self.path, self.rank, self.size, self.slot_bytes, FLAG_STRIDE, SPIN_BEFORE_SLEEP, TIMEOUT_S

    def _publish_and_wait(self, count: int) -> None:
        """Collective ``count``: say this rank's slot is written, then wait for every rank's."""
        self.flags[self.rank] = count
        spins, deadline = 0, None
        while int(self.flags.min()) < count:
            spins += 1
            if spins > SPIN_BEFORE_SLEEP:  # a long wait (the other rank is prefilling, or its core is shared)
                os.sched_yield()
                deadline = deadline or time.monotonic() + TIMEOUT_S
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {self.rank}: the other ranks did not reach collective "
                                       f"{count} within {TIMEOUT_S:.0f} s")

    def _exchange(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``flat`` (bytes, at most a slot), in rank order, as views of the segment
        valid until this rank's next collective."""
        count = int(self.flags[self.rank]) + 1
        slots = self.slots[count % 2]
        slots[self.rank][:flat.numel()].copy_(flat)
        self._publish_and_wait(count)
        return [slot[:flat.numel()] for slot in slots]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        src, dst = x.contiguous().view(-1), out.view(-1)
        step = self.slot_bytes // x.element_size()
        for start in range(0, src.numel(), step):
            piece = src[start:start + step]
            parts = [p.view(x.dtype) for p in self._exchange(piece.view(torch.uint8))]
            total = dst[start:start + piece.numel()]
            torch.add(parts[0], parts[1], out=total)
            for part in parts[2:]:
                total += part
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        src = x.contiguous().view(-1)
        gathered = torch.empty((self.size, src.numel()), dtype=x.dtype, device=x.device)
        step = self.slot_bytes // x.element_size()
        for start in range(0, src.numel(), step):
            piece = src[start:start + step]
            for r, part in enumerate(self._exchange(piece.view(torch.uint8))):
                gathered[r, start:start + piece.numel()] = part.view(x.dtype)
        # [size, *x.shape] -> x.shape with the last dimension size times longer, in rank order
        return torch.cat(list(gathered.view(self.size, *x.shape)), dim=-1)

