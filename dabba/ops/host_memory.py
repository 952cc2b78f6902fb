"""Host memory laid out for the kernels that stream it: 2 MiB pages (Linux's transparent huge pages).

A GEMV streams its weight once per step; the CPU's prefetchers stop at every 4 KiB page boundary
and each new page costs a TLB miss, so a weight on small pages is read well below the memory's
bandwidth. Where THP is "madvise" (the usual default) nothing gets 2 MiB pages unless asked.
Best effort: where madvise or THP is unavailable the memory is ordinary.

Weights are packed one after another into shared regions of huge pages (an arena), not each
given a mapping of its own: a small model's small linears (a 0.5B model's k and v, a few hundred
KiB) would otherwise sit on small pages, and every large one's tail past its last whole 2 MiB
page too. The arena never reuses memory: a region lives while any tensor cut from it does.
"""
from __future__ import annotations

import ctypes
import mmap
import sys
import threading

import torch

HUGE_PAGE = 2 * 2**20
SMALL_PAGE = 4096  # tensors smaller than a page stay ordinary: no prefetcher or TLB cost to save
ARENA_REGION = 64 * 2**20  # a region's size, unless one tensor needs more
ARENA_ALIGN = 64  # each tensor starts on a cache line
_MADV_HUGEPAGE = 14


def advise_huge_pages(t: torch.Tensor) -> None:
    """Ask Linux to back a large CPU tensor's whole 2 MiB pages with huge pages, before it is first
    touched (pages already touched stay as they are until the kernel collapses them)."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    aligned = (start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    if end - aligned < HUGE_PAGE:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(aligned), ctypes.c_size_t((end - aligned) // HUGE_PAGE * HUGE_PAGE), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass


def _region(nbytes: int) -> torch.Tensor:
    """An untouched uint8 CPU tensor of ``nbytes`` (a multiple of HUGE_PAGE) on its own anonymous
    mapping, starting on a 2 MiB boundary and advised onto huge pages: malloc would hand out heap
    memory that may already be touched, or not aligned. The slack before the boundary is never
    touched, so never resident."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    offset = -whole.data_ptr() % HUGE_PAGE
    t = whole[offset:offset + nbytes]
    advise_huge_pages(t)
    return t


class _Arena:
    """Cuts tensors from the current region in order; one that does not fit starts a new region
    (ARENA_REGION, or the tensor's size rounded up to whole huge pages), whose rest the next
    tensors take. The old region's untouched huge pages past its last tensor are never resident."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._region: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        # never inference tensors: a region first cut inside torch.inference_mode (a load there) would
        # refuse writes to the weights cut from it later outside it
        with self._lock, torch.inference_mode(False):
            start = -(-self._used // ARENA_ALIGN) * ARENA_ALIGN
            if self._region is None or start + nbytes > self._region.numel():
                self._region = _region(max(ARENA_REGION, -(-nbytes // HUGE_PAGE) * HUGE_PAGE))
                start = 0
            self._used = start + nbytes
            return self._region[start:start + nbytes]


_ARENA = _Arena()


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """An untouched uint8 CPU tensor of ``nbytes`` on huge pages (the arena's), starting on a cache
    line; smaller than a page, or off Linux, an ordinary one."""
    if nbytes < SMALL_PAGE or not sys.platform.startswith("linux"):
        return torch.empty(nbytes, dtype=torch.uint8)
    return _ARENA.take(nbytes)


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied onto 2 MiB pages (huge_page_bytes): a quantized weight the GEMV streams every
    step. Off the CPU, or smaller than a page, ``t`` itself."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < SMALL_PAGE:
        return t
    out = huge_page_bytes(nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
