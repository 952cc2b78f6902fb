"""Host memory laid out for the kernels that stream it: 2 MiB pages (Linux's transparent huge pages).

A GEMV streams its weight once per step; the CPU's prefetchers stop at every 4 KiB page boundary
and each new page costs a TLB miss, so a weight on small pages is read well below the memory's
bandwidth. Where THP is "madvise" (the usual default) nothing gets 2 MiB pages unless asked.
Best effort: where madvise or THP is unavailable the memory is ordinary.
"""
from __future__ import annotations

import ctypes
import mmap
import sys

import torch

HUGE_PAGE = 2 * 2**20
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


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """An untouched uint8 CPU tensor of ``nbytes`` on its own anonymous mapping, starting on a
    2 MiB boundary and advised onto huge pages: malloc would hand out heap memory that may already
    be touched, or not aligned. The slack before the boundary is never touched, so never resident."""
    if nbytes < HUGE_PAGE or not sys.platform.startswith("linux"):
        return torch.empty(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    offset = -whole.data_ptr() % HUGE_PAGE
    t = whole[offset:offset + nbytes]
    advise_huge_pages(t)
    return t


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied onto 2 MiB pages (huge_page_bytes): a quantized weight the GEMV streams every
    step. Off the CPU, or smaller than a huge page, ``t`` itself."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < HUGE_PAGE:
        return t
    out = huge_page_bytes(nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
