"""dabba's layouts of GGUF blocks (quantization/gguf_repack.py): the same bytes a row, the file's
blocks back exactly, the byte orders the kernels read, the same values from the native
dequantization, and a layout chosen only where a row holds a whole run."""
from __future__ import annotations

import pytest
import torch

from dabba.ops import native
from dabba.quantization.gguf import GGUFBlocks, dequantize_rows
from dabba.quantization.gguf_blocks import _k_scale_min, dequantize
from dabba.quantization.gguf_repack import LAYOUTS, _q6_k_codes, file_type, layout_for, repack, unpack
from tools.random_gguf import random_blocks

# one run of 512 values; a run and blocks past it; TinyLlama's and Qwen2.5-0.5B's widths
WIDTHS = {"Q4_0x16": [512, 512 + 96, 2048, 5632, 896, 4864], "Q5_0x16": [512, 512 + 96, 896, 4864],
          "Q8_0x16": [512, 512 + 96, 896, 2048, 4864],
          "Q4_Kx2": [512, 768, 2048, 5632, 4864],
          "Q5_Kx2": [512, 768, 5632],
          "Q6_Kx1": [256, 768, 5632]}
CASES = [(layout, columns) for layout, widths in WIDTHS.items() for columns in widths]


@pytest.mark.parametrize("layout, columns", CASES)
def test_a_row_keeps_its_bytes_and_unpacks_to_the_files_blocks(layout, columns) -> None:
    blocks = random_blocks(file_type(layout), 5, columns, seed=columns)
    packed = repack(layout, blocks.data, columns)
    assert packed.shape == blocks.data.shape and packed.dtype == torch.uint8
    assert not torch.equal(packed, blocks.data)
    assert torch.equal(unpack(layout, packed, columns), blocks.data)
    run_bytes = blocks.data.shape[1] * LAYOUTS[layout].run_values // columns
    past = columns // LAYOUTS[layout].run_values * run_bytes
    if not LAYOUTS[layout].partial_tail:
        assert torch.equal(packed[:, past:], blocks.data[:, past:])  # the blocks past the last run
    elif past < packed.shape[1]:  # they form a last run of fewer blocks: laid out too
        assert not torch.equal(packed[:, past:], blocks.data[:, past:])
    ref = dequantize(file_type(layout), blocks.data, (5, columns))
    assert torch.equal(GGUFBlocks(layout, packed, columns).dequantize(), ref)


def test_the_byte_order_is_the_kernels() -> None:
    """Byte 64 l + 4 j + r of a run holds block j's values 8 l + r (low nibble) and 8 l + 4 + r."""
    blocks = random_blocks("Q4_0", 1, 512, seed=0)
    raw = blocks.data.view(16, 18)
    values = torch.cat([raw[:, 2:] & 0x0F, raw[:, 2:] >> 4], dim=1)  # [block, 32]
    packed = repack("Q4_0x16", blocks.data, 512)[0]
    assert torch.equal(packed[:32].view(16, 2), raw[:, :2])  # the 16 scales first
    for l, j, r in [(0, 0, 0), (1, 3, 2), (3, 15, 3), (2, 7, 1)]:
        byte = packed[32 + 64 * l + 4 * j + r].item()
        assert byte & 0x0F == values[j, 8 * l + r] and byte >> 4 == values[j, 8 * l + 4 + r]


@pytest.mark.parametrize("g, at", [(16, 0), (12, 352)])  # a row of 896: a whole run, then a partial one
def test_q5_0_fifth_bits_follow_the_nibbles(g, at) -> None:
    """Q5_0x16: after the scales and nibbles (as Q4_0x16's), bit 2 l + h of byte 4 j + r of the
    fifth bits is that of the value in nibble h of byte 4 g l + 4 j + r: block j's value 8 l + 4 h + r."""
    blocks = random_blocks("Q5_0", 1, 896, seed=2)
    raw = blocks.data.view(28, 22)[at // 22:at // 22 + g]
    qh = sum(raw[:, 2 + i].to(torch.int64) << (8 * i) for i in range(4))
    codes = torch.cat([raw[:, 6:] & 0x0F, raw[:, 6:] >> 4], dim=1).to(torch.int64) | (
        ((qh.unsqueeze(1) >> torch.arange(32)) & 1) << 4)  # [block, 32]: the 5-bit codes
    run = repack("Q5_0x16", blocks.data, 896)[0, at:at + 22 * g]
    assert torch.equal(run[:2 * g].view(g, 2), raw[:, :2])
    for l, h, j, r in [(0, 0, 0, 0), (1, 1, 3, 2), (3, 1, g - 1, 3), (2, 0, 7, 1)]:
        nibble = run[2 * g + 4 * g * l + 4 * j + r].item() >> (4 * h) & 0x0F
        fifth = run[18 * g + 4 * j + r].item() >> (2 * l + h) & 1
        assert nibble | fifth << 4 == codes[j, 8 * l + 4 * h + r]


@pytest.mark.parametrize("g, at", [(16, 0), (12, 544)])  # a row of 896: a whole run, then a partial one
def test_q8_0_codes_lie_as_vpdpbusd_takes_them(g, at) -> None:
    """Q8_0x16: the g scales, then byte 4 g t + 4 j + r holds block j's code 4 t + r plus 128."""
    blocks = random_blocks("Q8_0", 1, 896, seed=3)
    raw = blocks.data.view(28, 34)[at // 34:at // 34 + g]
    raw[3, 2 + 6], raw[g - 1, 2 + 31] = 0x80, 0x7F  # the edge codes, -128 and 127
    codes = raw[:, 2:].view(torch.int8).to(torch.int32)  # [block, 32]
    run = repack("Q8_0x16", blocks.data, 896)[0, at:at + 34 * g]
    assert torch.equal(run[:2 * g].view(g, 2), raw[:, :2])
    for t, j, r in [(0, 0, 0), (1, 3, 2), (7, g - 1, 3), (4, 7, 1)]:  # (1, 3, 2): -128; (7, g - 1, 3): 127
        assert run[2 * g + 4 * g * t + 4 * j + r].item() == codes[j, 4 * t + r].item() + 128


def test_a_rows_last_blocks_form_a_partial_run_laid_out_alike() -> None:
    """Q4_0x16: a row of 28 blocks (Qwen2.5-0.5B's 896) holds a run of 16 and one of 12: the 12
    scales, then byte 48 l + 4 j + r holds block j's values 8 l + r and 8 l + 4 + r."""
    blocks = random_blocks("Q4_0", 1, 896, seed=1)
    raw = blocks.data.view(28, 18)[16:]
    values = torch.cat([raw[:, 2:] & 0x0F, raw[:, 2:] >> 4], dim=1)  # [block, 32]
    tail = repack("Q4_0x16", blocks.data, 896)[0, 288:]
    assert torch.equal(tail[:24].view(12, 2), raw[:, :2])
    for l, j, r in [(0, 0, 0), (1, 3, 2), (3, 11, 3), (2, 7, 1)]:
        byte = tail[24 + 48 * l + 4 * j + r].item()
        assert byte & 0x0F == values[j, 8 * l + r] and byte >> 4 == values[j, 8 * l + 4 + r]


def test_a_q4_k_run_holds_its_scales_and_mins_as_the_kernel_reads_them() -> None:
    """d, d, dmin, dmin; then per sub-block the low 4 bits of scale and min; then their top 2 bits."""
    blocks = random_blocks("Q4_K", 1, 512, seed=2)
    raw = blocks.data.view(2, 144)
    sc, mn = _k_scale_min(raw[:, 4:16])  # [2 super-blocks, 8]
    run = repack("Q4_Kx2", blocks.data, 512)[0]
    assert torch.equal(run[:8].view(2, 2, 2), raw[:, :4].view(2, 2, 2).transpose(0, 1))
    high_sc, high_mn = (int.from_bytes(bytes(run[at:at + 4].tolist()), "little") for at in (24, 28))
    for j in range(16):
        byte = run[8 + j].item()
        assert (byte & 0x0F) | ((high_sc >> 2 * j & 3) << 4) == sc[j // 8, j % 8]
        assert (byte >> 4) | ((high_mn >> 2 * j & 3) << 4) == mn[j // 8, j % 8]


def test_a_q5_k_run_holds_its_fifth_bits_as_the_kernel_reads_them() -> None:
    """Q4_Kx2's bytes for the codes' low 4 bits, then bit 2 l + h of byte 288 + 4 j + r: the fifth bit
    of sub-block j's value 8 l + 4 h + r."""
    blocks = random_blocks("Q5_K", 1, 512, seed=3)
    raw = blocks.data.view(2, 176)
    run = repack("Q5_Kx2", blocks.data, 512)[0]
    for j, l, h, r in [(0, 0, 0, 0), (5, 1, 1, 2), (15, 3, 1, 3), (8, 2, 0, 1), (11, 3, 0, 0)]:
        block, s, value = j // 8, j % 8, 8 * l + 4 * h + r  # super-block, its sub-block, the value in it
        code = raw[block, 48 + 32 * (s // 2) + value].item()
        code = (code >> 4 if s % 2 else code & 0x0F) | ((raw[block, 16 + value].item() >> s) & 1) << 4
        nibble = run[32 + 64 * l + 4 * j + r].item()
        assert (nibble >> 4 if h else nibble & 0x0F) == code & 0x0F
        assert (run[288 + 4 * j + r].item() >> (2 * l + h)) & 1 == code >> 4


def test_a_q6_k_run_holds_its_codes_as_the_kernel_reads_them() -> None:
    """Byte 64 L + 4 j + r: sub-block j's values 8 L + r and 8 L + 4 + r, low 4 bits; byte 128 + 4 j + r:
    the top 2 bits of its value 4 t + r at bits 2 t; then the file's scales and d."""
    blocks = random_blocks("Q6_K", 1, 256, seed=4)
    codes = _q6_k_codes(blocks.data.view(1, 210))[0].view(16, 16)  # [sub-block, value]
    run = repack("Q6_Kx1", blocks.data, 256)[0]
    assert torch.equal(run[192:], blocks.data[0, 192:])
    for j, value in [(0, 0), (3, 5), (15, 15), (9, 12), (7, 10)]:
        low_byte = run[64 * (value // 8) + 4 * j + value % 4].item()
        low = low_byte >> 4 if value % 8 >= 4 else low_byte & 0x0F
        top = run[128 + 4 * j + value % 4].item() >> (2 * (value // 4)) & 3
        assert low | top << 4 == codes[j, value]


@pytest.mark.skipif(not native.load_cpu_ops(), reason="native CPU kernels unavailable")
@pytest.mark.parametrize("layout, columns", CASES)
def test_the_native_dequantization_is_the_files_bit_for_bit(layout, columns) -> None:
    blocks = random_blocks(layout, 9, columns, seed=1)
    ref = dequantize(file_type(layout), unpack(layout, blocks.data, columns), (9, columns))
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_rows(layout, blocks.data, columns, dtype), ref.to(dtype))


def test_the_layout_is_taken_where_a_row_holds_a_run() -> None:
    assert layout_for("Q4_0", 512) == layout_for("Q4_0", 896) == "Q4_0x16"
    assert layout_for("Q4_K", 512) == layout_for("Q4_K", 5632) == "Q4_Kx2"
    assert layout_for("Q4_0", 480) is None and layout_for("Q4_K", 256) is None  # short of a run
    assert layout_for("Q6_K", 256) == "Q6_Kx1"  # a run is one super-block
    assert layout_for("Q5_K", 4096) == "Q5_Kx2" and layout_for("Q5_K", 256) is None
    assert layout_for("Q5_0", 896) == "Q5_0x16" and layout_for("Q5_0", 480) is None
    assert layout_for("Q8_0", 896) == "Q8_0x16" and layout_for("Q8_0", 480) is None
    assert layout_for("Q5_1", 4096) is None and layout_for("Q4_1", 4096) is None
    assert file_type("Q4_0x16") == "Q4_0" and file_type("Q6_Kx1") == "Q6_K" and file_type("Q8_0") == "Q8_0"


def test_bad_operands_are_refused() -> None:
    blocks = random_blocks("Q4_0", 2, 512, seed=0)
    with pytest.raises(ValueError, match="not 544 values"):
        repack("Q4_0x16", blocks.data, 544)
    with pytest.raises(ValueError, match="no layout 'Q4_Kx16'"):
        repack("Q4_Kx16", blocks.data, 512)
    with pytest.raises(ValueError, match="cut before it is repacked"):
        GGUFBlocks("Q4_0x16", repack("Q4_0x16", blocks.data, 512), 512).narrow_columns(0, 256)


def test_a_layout_is_written_into_a_given_buffer_a_chunk_of_rows_at_a_time(monkeypatch) -> None:
    """The load writes layouts straight into the GEMV's buffer, a few rows at a time (CHUNK_BYTES)."""
    import dabba.quantization.gguf_repack as gguf_repack
    blocks = random_blocks("Q6_K", 7, 768, seed=9)
    whole = repack("Q6_Kx1", blocks.data, 768)
    monkeypatch.setattr(gguf_repack, "CHUNK_BYTES", 2 * blocks.data.shape[1])  # chunks of 2 rows, and a last of 1
    out = torch.zeros_like(blocks.data)
    assert repack("Q6_Kx1", blocks.data, 768, out=out) is out and torch.equal(out, whole)
    with pytest.raises(ValueError, match="out must be uint8"):
        repack("Q6_Kx1", blocks.data, 768, out=torch.zeros(7, 10, dtype=torch.uint8))
