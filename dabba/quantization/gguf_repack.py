"""dabba's own layouts of GGUF blocks, made at load for the GEMV (as llama.cpp repacks Q4_0 and
Q4_K for its CPU kernels): the same bytes a row, the same values, in an order that costs the
kernel fewer instructions a byte. The file's blocks stay the reference: a layout dequantizes by
going back to them.

Q4_0x16 (csrc/gguf_blocks.h, whose comment gives the byte order): each run of 16 Q4_0 blocks of a
row as their 16 float16 scales, then their 512 nibbles ordered so that one 64-byte load holds 4
values of every block: a vpdpbusd's 16 lanes are the 16 blocks, and the per-block products never
leave int32 until one conversion and one multiply by the 16 scales. A row's last blocks short of
16 stay as they are.
"""
from __future__ import annotations

import torch

GROUP_BLOCKS = 16  # Q4_0 blocks a Q4_0x16 run holds
Q4_0_BYTES = 18  # a Q4_0 block: a float16 scale, then 16 bytes of nibbles (value i low, 16 + i high)
LAYOUTS = {"Q4_0x16": "Q4_0"}  # dabba's layout -> the file's type whose blocks it holds


def file_type(type_name: str) -> str:
    """The file's type whose blocks a layout (or the type itself) holds."""
    return LAYOUTS.get(type_name, type_name)


def layout_for(type_name: str, columns: int) -> str | None:
    """The layout the GEMV takes for a row of ``columns`` values of ``type_name``, None to keep the
    file's blocks (no layout for the type, or too short a row for one run)."""
    if type_name == "Q4_0" and columns // 32 >= GROUP_BLOCKS:
        return "Q4_0x16"
    return None


def _runs(data: torch.Tensor, columns: int) -> tuple[int, int]:
    """(rows, full runs a row) of a [rows, row bytes] Q4_0 tensor."""
    rows, nbytes = data.shape
    if columns % 32 or nbytes != columns // 32 * Q4_0_BYTES:
        raise ValueError(f"{nbytes} bytes a row are not {columns} values of Q4_0 blocks")
    return rows, columns // 32 // GROUP_BLOCKS


def repack(type_name: str, data: torch.Tensor, columns: int) -> torch.Tensor:
    """The file's Q4_0 rows [rows, row bytes] uint8 -> the same rows as Q4_0x16."""
    if type_name != "Q4_0x16":
        raise ValueError(f"no layout {type_name!r}; dabba's are {sorted(LAYOUTS)}")
    rows, runs = _runs(data, columns)
    run_bytes = GROUP_BLOCKS * Q4_0_BYTES
    blocks = data[:, :runs * run_bytes].reshape(rows, runs, GROUP_BLOCKS, Q4_0_BYTES)
    scales = blocks[..., :2].reshape(rows, runs, 2 * GROUP_BLOCKS)
    qs = blocks[..., 2:]
    values = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [rows, runs, block j, value 0..31]
    # value 8 l + 4 h + r of block j -> nibble h of byte 64 l + 4 j + r
    v = values.reshape(rows, runs, GROUP_BLOCKS, 4, 2, 4)  # [.., j, l, h, r]
    nibbles = (v[..., 0, :] | (v[..., 1, :] << 4)).permute(0, 1, 3, 2, 4)  # [.., l, j, r]
    runs_out = torch.cat([scales, nibbles.reshape(rows, runs, 16 * GROUP_BLOCKS)], dim=-1).reshape(rows, runs * run_bytes)
    return torch.cat([runs_out, data[:, runs * run_bytes:]], dim=1).contiguous()


def unpack(type_name: str, data: torch.Tensor, columns: int) -> torch.Tensor:
    """A layout's rows -> the file's blocks they hold (repack's inverse)."""
    if type_name not in LAYOUTS:
        raise ValueError(f"no layout {type_name!r}; dabba's are {sorted(LAYOUTS)}")
    rows, runs = _runs(data, columns)
    run_bytes = GROUP_BLOCKS * Q4_0_BYTES
    packed = data[:, :runs * run_bytes].reshape(rows, runs, run_bytes)
    scales = packed[..., :2 * GROUP_BLOCKS].reshape(rows, runs, GROUP_BLOCKS, 2)
    nibbles = packed[..., 2 * GROUP_BLOCKS:].reshape(rows, runs, 4, GROUP_BLOCKS, 4).permute(0, 1, 3, 2, 4)
    v = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-2)  # [.., j, l, h, r]
    values = v.reshape(rows, runs, GROUP_BLOCKS, 32)
    qs = values[..., :16] | (values[..., 16:] << 4)
    blocks = torch.cat([scales, qs], dim=-1).reshape(rows, runs * run_bytes)
    return torch.cat([blocks, data[:, runs * run_bytes:]], dim=1).contiguous()
