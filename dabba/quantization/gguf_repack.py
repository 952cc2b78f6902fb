"""dabba's own layouts of GGUF blocks, made at load for the GEMV (as llama.cpp repacks Q4_0 and
Q4_K for its CPU kernels): the same bytes a row, the same values, in an order that costs the
kernel fewer instructions a byte. The file's blocks stay the reference: a layout dequantizes by
going back to them.

Every layout (csrc/gguf_blocks.h gives their byte orders) holds a run of 16 groups (16 Q4_0
blocks; two Q4_K super-blocks' 16 sub-blocks of 32; a Q6_K super-block's 16 sub-blocks of 16)
with their codes ordered so that one 64-byte load holds 4 values of every group: a vpdpbusd's 16
lanes are the 16 groups, and each group's products stay in int32 until it is scaled. A row's
blocks past its last whole run stay as the file has them, except the legacy layouts' (Q4_0x16,
Q5_0x16, Q8_0x16), which form a last run of fewer groups laid out alike (g blocks: 2 g bytes of
scales, then bytes 4 g l + 4 j + r, then Q5_0x16's fifth bits in 4 g bytes; Q8_0x16's codes in
bytes 4 g t + 4 j + r).

- Q4_0x16: the 16 blocks' float16 scales (32 bytes), then the nibbles (256).
- Q5_0x16: as Q4_0x16 (the 5-bit codes' low 4 bits as its nibbles), then their fifth bits (64
  bytes, as Q5_Kx2's).
- Q8_0x16: the 16 blocks' float16 scales (32 bytes), then their codes plus 128 as unsigned
  bytes (512: byte 64 t + 4 j + r holds block j's value 4 t + r), so that vpdpbusd takes them as
  they lie, against the activations' codes, the offset met by -128 times the activations' sums.
- Q4_Kx2: the two super-blocks' d, d, dmin, dmin (float16, 8 bytes); their 16 sub-blocks' 6-bit
  scales and mins, the low 4 bits of scale and min in one byte per sub-block (16 bytes), then the
  scales' top 2 bits, 2 bits per sub-block in a little-endian uint32, and the mins' likewise (8
  bytes); then the nibbles (256).
- Q5_Kx2: as Q4_Kx2 (the 5-bit codes' low 4 bits as its nibbles), then their fifth bits (64 bytes:
  bit 2 l + h of byte 4 j + r is that of the value in nibble h of byte 64 l + 4 j + r).
- Q6_Kx1: the 6-bit codes' low 4 bits (128 bytes: byte 64 L + 4 j + r holds sub-block j's values
  8 L + r and 8 L + 4 + r), their top 2 bits (64 bytes: bits 2 t of byte 4 j + r for value 4 t + r),
  then the 16 int8 scales and d, as the file has them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dabba.quantization.gguf_blocks import BLOCKS, _k_scale_min


@dataclass(frozen=True)
class Layout:
    file_type: str  # the file's type whose blocks it holds
    run_blocks: int  # of the file's blocks a run holds
    partial_tail: bool = False  # a row's blocks past its last whole run form a run of fewer groups

    @property
    def run_values(self) -> int:
        return BLOCKS[self.file_type][0] * self.run_blocks


LAYOUTS = {"Q4_0x16": Layout("Q4_0", 16, partial_tail=True), "Q5_0x16": Layout("Q5_0", 16, partial_tail=True),
           "Q8_0x16": Layout("Q8_0", 16, partial_tail=True),
           "Q4_Kx2": Layout("Q4_K", 2), "Q5_Kx2": Layout("Q5_K", 2),
           "Q6_Kx1": Layout("Q6_K", 1)}


def file_type(type_name: str) -> str:
    """The file's type whose blocks a layout (or the type itself) holds."""
    layout = LAYOUTS.get(type_name)
    return layout.file_type if layout else type_name


def layout_for(type_name: str, columns: int) -> str | None:
    """The layout the GEMV takes for a row of ``columns`` values of ``type_name``, None to keep the
    file's blocks (no layout for the type, or too short a row for one run)."""
    return next((name for name, layout in LAYOUTS.items()
                 if layout.file_type == type_name and columns >= layout.run_values), None)


def _check(type_name: str, data: torch.Tensor, columns: int) -> tuple[Layout, int, int]:
    """(the layout, rows, full runs a row) of [rows, row bytes] blocks of the layout's file type."""
    layout = LAYOUTS.get(type_name)
    if layout is None:
        raise ValueError(f"no layout {type_name!r}; dabba's are {sorted(LAYOUTS)}")
    block, size = BLOCKS[layout.file_type]
    rows, nbytes = data.shape
    if columns % block or nbytes != columns // block * size:
        raise ValueError(f"{nbytes} bytes a row are not {columns} values of {layout.file_type} blocks")
    return layout, rows, columns // layout.run_values


def _pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """[..., g groups, 32 values] of 0..15 -> [..., 16 g] bytes: byte 4 g l + 4 j + r holds group j's
    values 8 l + r (low nibble) and 8 l + 4 + r (high)."""
    g = values.shape[-2]
    v = values.reshape(*values.shape[:-2], g, 4, 2, 4)  # [.., j, l, h, r]
    return (v[..., 0, :] | (v[..., 1, :] << 4)).transpose(-3, -2).reshape(*values.shape[:-2], 16 * g)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """_pack_nibbles' inverse: [..., 16 g] -> [..., g, 32]."""
    g = packed.shape[-1] // 16
    nibbles = packed.reshape(*packed.shape[:-1], 4, g, 4).transpose(-3, -2)  # [.., j, l, r]
    return torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-2).reshape(*packed.shape[:-1], g, 32)


def _pack_fifth_bits(bits: torch.Tensor) -> torch.Tensor:
    """[..., g groups, 32 values] of 0..1 -> [..., 4 g] bytes: bit 2 l + h of byte 4 j + r is group
    j's value 8 l + 4 h + r (the value _pack_nibbles puts in nibble h of byte 4 g l + 4 j + r)."""
    g = bits.shape[-2]
    b = bits.reshape(*bits.shape[:-2], g, 4, 2, 4).to(torch.int32)  # [.., j, l, h, r]
    shifts = (2 * torch.arange(4).reshape(4, 1, 1) + torch.arange(2).reshape(1, 2, 1)).to(torch.int32)
    return (b << shifts).sum((-3, -2)).to(torch.uint8).reshape(*bits.shape[:-2], 4 * g)


def _unpack_fifth_bits(packed: torch.Tensor) -> torch.Tensor:
    """_pack_fifth_bits' inverse: [..., 4 g] -> [..., g, 32]."""
    g = packed.shape[-1] // 4
    shifts = (2 * torch.arange(4).reshape(4, 1, 1) + torch.arange(2).reshape(1, 2, 1)).to(torch.uint8)
    b = (packed.reshape(*packed.shape[:-1], g, 1, 1, 4) >> shifts) & 1  # [.., j, l, h, r]
    return b.reshape(*packed.shape[:-1], g, 32)


def _q5_0_fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes of a Q5_0 block's qh (bit v of the little-endian uint32: value v's fifth
    bit) -> [..., 32] of 0..1."""
    return ((qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(*qh.shape[:-1], 32)


def _two_bits(values: torch.Tensor) -> torch.Tensor:
    """[..., 16] of 0..3 -> [..., 4] bytes: value i at bits 2 i of a little-endian uint32."""
    word = (values.to(torch.int64) << (2 * torch.arange(16))).sum(-1)
    return torch.stack([(word >> (8 * b)) & 0xFF for b in range(4)], dim=-1).to(torch.uint8)


def _from_two_bits(raw: torch.Tensor) -> torch.Tensor:
    """_two_bits' inverse: [..., 4] bytes -> [..., 16]."""
    word = sum(raw[..., b].to(torch.int64) << (8 * b) for b in range(4))
    return ((word.unsqueeze(-1) >> (2 * torch.arange(16))) & 3).to(torch.uint8)


def _q6_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """[n, 210] Q6_K super-blocks -> [n, 256] their 6-bit codes (value = d * scale * (code - 32))."""
    ql = blocks[:, :128].reshape(-1, 2, 2, 32)  # [n, half, ql[l] | ql[l + 32], l]
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    low = torch.stack([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 2, 4, 32)  # quarter q = 2 * nibble + byte
    high = (qh >> (2 * torch.arange(4, dtype=torch.uint8)).reshape(1, 1, 4, 1)) & 3
    return (low | (high << 4)).reshape(-1, 256)


def _q6_k_bits(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_q6_k_codes' inverse: [n, 256] codes -> the file's ql [n, 128] and qh [n, 64]."""
    c = codes.reshape(-1, 2, 2, 2, 32)  # [n, half, nibble, byte, l]: quarter 2 * nibble + byte
    ql = (c[:, :, 0] & 0x0F) | ((c[:, :, 1] & 0x0F) << 4)  # [n, half, byte, l]
    top = (codes.reshape(-1, 2, 4, 32) >> 4).to(torch.int32) << (2 * torch.arange(4, dtype=torch.int32)).reshape(1, 1, 4, 1)
    return ql.reshape(-1, 128), top.sum(2).to(torch.uint8).reshape(-1, 64)


def _repack_runs(layout: Layout, runs: torch.Tensor) -> torch.Tensor:
    """[rows, runs, run bytes] of the file's blocks -> the layout's."""
    if layout.file_type == "Q6_K":
        blocks = runs.reshape(-1, 210)
        codes = _q6_k_codes(blocks).reshape(-1, 16, 4, 4)  # [n, sub-block j, t, r]: value 16 j + 4 t + r
        v = (codes & 0x0F).reshape(-1, 16, 2, 2, 4)  # [n, j, L, h, r]
        low = (v[..., 0, :] | (v[..., 1, :] << 4)).transpose(1, 2).reshape(-1, 128)  # [n, L, j, r]
        top = ((codes >> 4).to(torch.int32) << (2 * torch.arange(4, dtype=torch.int32)).reshape(1, 1, 4, 1)).sum(2)
        return torch.cat([low, top.to(torch.uint8).reshape(-1, 64), blocks[:, 192:]], dim=-1).reshape(runs.shape)
    if layout.file_type == "Q8_0":  # g blocks a run: byte 4 g t + 4 j + r <- block j's code 4 t + r, + 128
        g = runs.shape[-1] // 34
        blocks = runs.reshape(*runs.shape[:2], g, 34)
        codes = (blocks[..., 2:] ^ 0x80).reshape(*runs.shape[:2], g, 8, 4).transpose(-3, -2)
        return torch.cat([blocks[..., :2].reshape(*runs.shape[:2], 2 * g), codes.reshape(*runs.shape[:2], 32 * g)], -1)
    if layout.file_type in ("Q4_0", "Q5_0"):  # g blocks a run (16, or fewer in a row's partial last run)
        five = layout.file_type == "Q5_0"
        size = 22 if five else 18
        g = runs.shape[-1] // size
        blocks = runs.reshape(*runs.shape[:2], g, size)
        qs = blocks[..., size - 16:]
        values = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [.., block, 32]
        parts = [blocks[..., :2].reshape(*runs.shape[:2], 2 * g), _pack_nibbles(values)]
        if five:
            parts.append(_pack_fifth_bits(_q5_0_fifth_bits(blocks[..., 2:6])))
        return torch.cat(parts, dim=-1)
    five = layout.file_type == "Q5_K"  # Q4_K or Q5_K super-blocks, two a run
    blocks = runs.reshape(-1, 176 if five else 144)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    qs = blocks[:, 48 if five else 16:].reshape(-1, 4, 32)
    values = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(*runs.shape[:2], 16, 32)  # sub-block j's 32
    sc, mn = sc.reshape(*runs.shape[:2], 16), mn.reshape(*runs.shape[:2], 16)
    halves = blocks[:, :4].reshape(*runs.shape[:2], 2, 2, 2).transpose(-3, -2)  # [.., d|dmin, block, 2 bytes]
    scales = torch.cat([(sc & 0x0F) | ((mn & 0x0F) << 4), _two_bits(sc >> 4), _two_bits(mn >> 4)], dim=-1)
    parts = [halves.reshape(*runs.shape[:2], 8), scales, _pack_nibbles(values)]
    if five:  # sub-block s's fifth bits: bit s of the file's qh[l]
        high = (blocks[:, 16:48].reshape(-1, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)) & 1
        parts.append(_pack_fifth_bits(high.reshape(*runs.shape[:2], 16, 32)))
    return torch.cat(parts, dim=-1)


def _unpack_runs(layout: Layout, runs: torch.Tensor) -> torch.Tensor:
    """_repack_runs' inverse."""
    if layout.file_type == "Q6_K":
        packed = runs.reshape(-1, 210)
        low = packed[:, :128].reshape(-1, 2, 16, 4).transpose(1, 2)  # [n, j, L, r]
        low = torch.stack([low & 0x0F, low >> 4], dim=-2)  # [n, j, L, h, r]
        top = (packed[:, 128:192].reshape(-1, 16, 1, 4) >> (2 * torch.arange(4, dtype=torch.uint8)).reshape(1, 1, 4, 1)) & 3
        codes = low.reshape(-1, 16, 4, 4) | (top << 4)  # [n, j, t, r]
        ql, qh = _q6_k_bits(codes.reshape(-1, 256))
        return torch.cat([ql, qh, packed[:, 192:]], dim=-1).reshape(runs.shape)
    if layout.file_type == "Q8_0":
        g = runs.shape[-1] // 34
        codes = (runs[..., 2 * g:] ^ 0x80).reshape(*runs.shape[:2], 8, g, 4).transpose(-3, -2)
        blocks = torch.cat([runs[..., :2 * g].reshape(*runs.shape[:2], g, 2), codes.reshape(*runs.shape[:2], g, 32)], -1)
        return blocks.reshape(runs.shape)
    if layout.file_type in ("Q4_0", "Q5_0"):
        five = layout.file_type == "Q5_0"
        g = runs.shape[-1] // (22 if five else 18)
        values = _unpack_nibbles(runs[..., 2 * g:18 * g])
        qs = values[..., :16] | (values[..., 16:] << 4)
        parts = [runs[..., :2 * g].reshape(*runs.shape[:2], g, 2)]
        if five:  # qh: value v's fifth bit at bit v % 8 of byte v // 8
            bits = _unpack_fifth_bits(runs[..., 18 * g:]).reshape(*runs.shape[:2], g, 4, 8).to(torch.int32)
            parts.append((bits << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8))
        return torch.cat([*parts, qs], dim=-1).reshape(runs.shape)
    halves = runs[..., :8].reshape(*runs.shape[:2], 2, 2, 2).transpose(-3, -2)  # [.., block, d|dmin, 2 bytes]
    low = runs[..., 8:24]
    sc = (low & 0x0F) | (_from_two_bits(runs[..., 24:28]) << 4)
    mn = (low >> 4) | (_from_two_bits(runs[..., 28:32]) << 4)
    sc, mn = sc.reshape(*runs.shape[:2], 2, 8), mn.reshape(*runs.shape[:2], 2, 8)
    # the file's 12 bytes of 6-bit scales and mins (gguf_blocks._k_scale_min's inverse)
    scales = torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                        (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)], dim=-1)
    values = _unpack_nibbles(runs[..., 32:288]).reshape(*runs.shape[:2], 2, 4, 2, 32)  # [.., block, pair, lo|hi, l]
    qs = (values[..., 0, :] | (values[..., 1, :] << 4)).reshape(*runs.shape[:2], 2, 128)
    parts = [halves.reshape(*runs.shape[:2], 2, 4), scales]
    if layout.file_type == "Q5_K":
        high = _unpack_fifth_bits(runs[..., 288:]).reshape(*runs.shape[:2], 2, 8, 32).to(torch.int32)
        qh = (high << torch.arange(8, dtype=torch.int32).reshape(8, 1)).sum(-2).to(torch.uint8)  # [.., block, 32]
        parts.append(qh)
    return torch.cat([*parts, qs], dim=-1).reshape(runs.shape)


CHUNK_BYTES = 1 << 20  # of rows converted at a time: the conversion's int32 temporaries stay small


def _convert(type_name: str, data: torch.Tensor, columns: int, runs_fn, out: torch.Tensor | None) -> torch.Tensor:
    """Rows' whole runs (and partial last run, where the layout has one) through ``runs_fn``; the
    bytes past them as they are. A few MB of rows at a time, into ``out`` (data's shape) or a new
    tensor: a model's load writes the layout straight into the buffer the GEMV reads."""
    layout, rows, runs = _check(type_name, data, columns)
    run_bytes = data.shape[1] * layout.run_values // columns
    if out is None:
        out = torch.empty_like(data)
    elif out.shape != data.shape or out.dtype != torch.uint8:
        raise ValueError(f"out must be uint8 of shape {tuple(data.shape)}, not {out.dtype} {tuple(out.shape)}")
    step = max(1, CHUNK_BYTES // max(1, data.shape[1]))
    for first in range(0, rows, step):
        chunk = data[first:first + step]
        n = chunk.shape[0]
        out[first:first + n, :runs * run_bytes] = runs_fn(
            layout, chunk[:, :runs * run_bytes].reshape(n, runs, run_bytes)).reshape(n, -1)
        rest = chunk[:, runs * run_bytes:]
        if layout.partial_tail and rest.shape[1]:
            rest = runs_fn(layout, rest.reshape(n, 1, -1)).reshape(n, -1)
        out[first:first + n, runs * run_bytes:] = rest
    return out


def repack(type_name: str, data: torch.Tensor, columns: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The file's rows [rows, row bytes] uint8 -> the same rows in layout ``type_name``."""
    return _convert(type_name, data, columns, _repack_runs, out)


def unpack(type_name: str, data: torch.Tensor, columns: int) -> torch.Tensor:
    """A layout's rows -> the file's blocks they hold (repack's inverse)."""
    return _convert(type_name, data, columns, _unpack_runs, None)
