"""dabba/ops/host_memory.py: weights the GEMVs stream lie in regions of huge pages (2 MiB-aligned
mappings) packed one after another, are ordinary writable memory, and stay alive as long as the
tensor (or a view) does."""
from __future__ import annotations

import gc

import torch

from dabba.ops import host_memory
from dabba.ops.host_memory import ARENA_ALIGN, ARENA_REGION, HUGE_PAGE, SMALL_PAGE, huge_page_bytes


def test_large_buffers_start_on_a_huge_page_and_hold_what_is_written() -> None:
    t = huge_page_bytes(ARENA_REGION + 12345)  # larger than a region: a region of its own
    assert t.dtype == torch.uint8 and t.numel() == ARENA_REGION + 12345 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(7)
    view = t[-10:]
    del t
    gc.collect()
    assert view.tolist() == [7] * 10  # the mapping lives while a view does


def test_buffers_below_a_page_are_ordinary_tensors() -> None:
    t = huge_page_bytes(SMALL_PAGE - 1)
    assert t.numel() == SMALL_PAGE - 1 and t.dtype == torch.uint8


def test_small_weights_share_a_region_one_after_another_on_cache_lines() -> None:
    """A 0.5B model's k and v (a few hundred KiB) on huge pages too: each cut from the current region
    right after the one before, on the next cache line; one that does not fit starts a new region
    (on a huge page's boundary), and a weight larger than a region gets one of its own whose rest
    the next weights take."""
    arena = host_memory._Arena()  # a fresh one: the module's may hold a region half used
    sizes = [SMALL_PAGE, 300_000, 5 * SMALL_PAGE + 3, 1_000_000]
    parts = [arena.take(n) for n in sizes]
    assert parts[0].data_ptr() % HUGE_PAGE == 0
    for before, (part, n) in zip(parts, zip(parts[1:], sizes[1:])):
        end = before.data_ptr() + before.numel()
        assert part.data_ptr() == -(-end // ARENA_ALIGN) * ARENA_ALIGN and part.numel() == n
    for i, part in enumerate(parts):
        part.fill_(i + 1)
    assert [int(p.min()) == int(p.max()) == i + 1 for i, p in enumerate(parts)] == [True] * len(parts)
    used = parts[-1].data_ptr() + parts[-1].numel() - parts[0].data_ptr()
    rest = arena.take(ARENA_REGION - used + 1)  # a byte more than the region has left: a new one
    assert rest.data_ptr() % HUGE_PAGE == 0 and rest.data_ptr() != parts[0].data_ptr()
    big = arena.take(ARENA_REGION + HUGE_PAGE + 1)  # a region of its own: 2 MiB pages rounded up
    assert big.data_ptr() % HUGE_PAGE == 0
    after = arena.take(SMALL_PAGE)  # the big one's last huge page has room
    assert after.data_ptr() == -(-(big.data_ptr() + big.numel()) // ARENA_ALIGN) * ARENA_ALIGN


def test_a_weight_moves_onto_huge_pages_with_its_values_dtype_and_shape() -> None:
    from dabba.ops.host_memory import on_huge_pages

    codes = torch.randint(-127, 128, (1024, 4096), dtype=torch.int8)  # 4 MiB
    moved = on_huge_pages(codes)
    assert moved.data_ptr() % ARENA_ALIGN == 0 and moved.dtype == codes.dtype and torch.equal(moved, codes)
    k_proj = torch.randn(128, 896).to(torch.bfloat16)  # 224 KiB: a region's too
    moved = on_huge_pages(k_proj)
    assert moved.data_ptr() != k_proj.data_ptr() and moved.shape == k_proj.shape and torch.equal(moved, k_proj)
    small = torch.ones(16, dtype=torch.bfloat16)
    assert on_huge_pages(small) is small


def test_weights_cut_inside_and_outside_inference_mode_take_writes_in_either() -> None:
    """A model loaded inside torch.inference_mode and one loaded outside it share the arena's
    regions: neither gets an inference tensor that the other mode could not write."""
    arena = host_memory._Arena()
    with torch.inference_mode():
        inside = arena.take(SMALL_PAGE)  # starts the region in inference mode
    outside = arena.take(SMALL_PAGE)
    outside.fill_(3)
    inside.fill_(1)
    with torch.inference_mode():
        outside.add_(1)
        inside.add_(1)
    assert not inside.is_inference() and not outside.is_inference()
    assert int(inside.max()) == 2 and int(outside.min()) == 4
