"""dabba/ops/host_memory.py: weights the GEMVs stream start on a 2 MiB boundary of their own
mapping, are ordinary writable memory, and stay alive as long as the tensor (or a view) does."""
from __future__ import annotations

import gc

import torch

from dabba.ops.host_memory import HUGE_PAGE, huge_page_bytes


def test_large_buffers_start_on_a_huge_page_and_hold_what_is_written() -> None:
    t = huge_page_bytes(3 * HUGE_PAGE + 12345)
    assert t.dtype == torch.uint8 and t.numel() == 3 * HUGE_PAGE + 12345 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(7)
    view = t[-10:]
    del t
    gc.collect()
    assert view.tolist() == [7] * 10  # the mapping lives while a view does


def test_small_buffers_are_ordinary_tensors() -> None:
    t = huge_page_bytes(1000)
    assert t.numel() == 1000 and t.dtype == torch.uint8


def test_a_weight_moves_onto_huge_pages_with_its_values_dtype_and_shape() -> None:
    from dabba.ops.host_memory import on_huge_pages

    codes = torch.randint(-127, 128, (1024, 4096), dtype=torch.int8)  # 4 MiB
    moved = on_huge_pages(codes)
    assert moved.data_ptr() % HUGE_PAGE == 0 and moved.dtype == codes.dtype and torch.equal(moved, codes)
    small = torch.ones(16, dtype=torch.bfloat16)
    assert on_huge_pages(small) is small
