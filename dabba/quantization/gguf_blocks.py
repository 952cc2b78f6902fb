"""GGUF's tensor types as blocks of bytes, and their dequantization in PyTorch: the reference the
native kernels are held to, equal to llama.cpp's gguf-py (``gguf.quants.dequantize``) bit for
bit, so it computes as gguf-py does: in float32, one rounding per operation, in its order.

A type's block holds ``BLOCK`` values in ``TYPE_SIZE`` bytes (gguf.constants.GGML_QUANT_SIZES).
The K types group 256 values into sub-blocks of 32 (Q4_K, Q5_K: a 6-bit scale and min each) or
16 (Q6_K: an 8-bit scale each) under one float16 scale (and min).
"""
from __future__ import annotations

import torch

QK_K = 256
# type -> (values per block, bytes per block)
BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210),
}


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 2] -> float32 [..., 1]."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] packed bytes -> [n, 32]: the low nibbles (values 0-15), then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _high_bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """[n, 4] bytes, a little-endian uint32 of fifth bits -> [n, count] bits (0 or 1)."""
    word = qh.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return ((word >> torch.arange(count)) & 1).to(torch.uint8)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6], 32) << 4)
    return _f16(b[:, :2]) * (q.to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8], 32) << 4)
    return _f16(b[:, :2]) * q.float() + _f16(b[:, 2:4])


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> ([n, 8], [n, 8])."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b[:, 0:2]) * sc.float()).reshape(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn.float()).reshape(n, 8, 1)
    qs = b[:, 16:].reshape(n, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b[:, 0:2]) * sc.float()).reshape(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn.float()).reshape(n, 8, 1)
    qh = b[:, 16:48].reshape(n, 1, 32)
    qs = b[:, 48:].reshape(n, 4, 32)
    ql = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32)
    high = ((qh >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)) & 1)
    return (d * (ql | (high << 4)).float() - dm).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, :128].reshape(n, 2, 1, 64), b[:, 128:192].reshape(n, 2, 1, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * scales).reshape(n, 16, 1)
    low = ((ql >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
    high = ((qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)) & 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, QK_K)


_BLOCK_DEQUANT = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
                  "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def row_bytes(type_name: str, num_values: int) -> int:
    block, size = BLOCKS[type_name]
    return num_values // block * size


def dequantize(type_name: str, raw: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's bytes (uint8, as in the file) -> float32 of ``shape`` (PyTorch order)."""
    raw = raw.reshape(-1)
    if type_name == "F32":
        return raw.view(torch.float32).reshape(shape).clone()
    if type_name == "F16":
        return raw.view(torch.float16).float().reshape(shape)
    if type_name == "BF16":
        return raw.view(torch.bfloat16).float().reshape(shape)
    block, size = BLOCKS[type_name]
    return _BLOCK_DEQUANT[type_name](raw.reshape(-1, size)).reshape(shape)
