"""8-bit KV cache: int8 or fp8 (float8_e4m3fn) values with one float32 scale per token and KV
head, symmetric: scale = max|x| / q_max, x ~ q * scale.

A token's keys (or values) for one head are a head_dim vector written once and read every
step after; one scale per vector keeps the error relative to that vector's own range, and costs
4 bytes per head_dim bytes (6% at head_dim 64). The cache then takes

    bytes per token = 2 (K and V) * layers * kv_heads * (head_dim * 1 + 4)

instead of 2 * layers * kv_heads * head_dim * p with p = 2 for bf16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
SCALE_DTYPE = torch.float32


@dataclass(frozen=True)
class KVQuant:
    """How a quantized cache stores and restores values. fp8 codes are kept as uint8 storage
    (copies and gathers of float8 tensors are not implemented everywhere) and reinterpreted."""

    kind: str  # "int8" | "fp8"
    compute_dtype: torch.dtype  # what attention reads them back as (the model's dtype)

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.int8 if self.kind == "int8" else torch.uint8

    @property
    def code_dtype(self) -> torch.dtype:
        """What the codes are: the storage reinterpreted, as the CPU kernels take it (the dtype
        tells them int8 from fp8)."""
        return torch.int8 if self.kind == "int8" else torch.float8_e4m3fn

    @property
    def q_max(self) -> float:
        return 127.0 if self.kind == "int8" else float(torch.finfo(torch.float8_e4m3fn).max)  # 448

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., head_dim] -> codes [..., head_dim] (storage dtype), scales [...] float32. The CPU
        backend's write_kv_cache (csrc/paged_attention_cpu.cpp, quantize_row) computes the same,
        bit for bit (tests/attention/test_kv_quant.py)."""
        xf = x.float()
        scale = (xf.abs().amax(dim=-1) / self.q_max).clamp(min=1e-12)
        y = xf / scale[..., None]
        if self.kind == "int8":
            return torch.round(y).clamp_(-self.q_max, self.q_max).to(torch.int8), scale
        return y.to(torch.float8_e4m3fn).view(torch.uint8), scale

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        values = codes.float() if self.kind == "int8" else codes.view(torch.float8_e4m3fn).float()
        return (values * scale[..., None]).to(self.compute_dtype)


def make_kv_quant(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVQuant | None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return None if kv_cache_dtype == "auto" else KVQuant(kv_cache_dtype, model_dtype)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str,
                       model_dtype: torch.dtype) -> int:
    """What one token's K and V take across all layers, scales included: the allocator's unit."""
    if kv_cache_dtype == "auto":
        return 2 * num_layers * num_kv_heads * head_dim * model_dtype.itemsize
    return 2 * num_layers * num_kv_heads * (head_dim + SCALE_DTYPE.itemsize)
