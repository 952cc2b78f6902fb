"""Choose the attention backend for a device."""
from __future__ import annotations

import torch

from dabba.attention.backend import AttentionBackend
from dabba.attention.cpu import CpuBackend
from dabba.attention.kv_quant import KVQuant
from dabba.attention.torch_ref import TorchRefBackend
from dabba import native

BACKENDS = ("auto", "torch_ref", "cpu")


def get_attention_backend(name: str, device: torch.device, kv_quant: KVQuant | None = None) -> AttentionBackend:
    """"auto": the native CPU backend on CPU when its kernel builds, else the reference. An 8-bit
    KV cache (``kv_quant``) runs on the reference backend: the native kernel reads bf16/fp32."""
    if name == "torch_ref" or (name == "auto" and kv_quant is not None):
        return TorchRefBackend(kv_quant)
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' needs device cpu, not {device.type}")
        if kv_quant is not None:
            raise ValueError("attention_backend='cpu' reads full-precision caches only: use kv_cache_dtype='auto' "
                             "or attention_backend='torch_ref'")
        if not native.load_cpu_ops():
            raise ValueError("attention_backend='cpu' but its kernel could not be built (see the log)")
        return CpuBackend()
    if device.type == "cpu" and native.load_cpu_ops():
        return CpuBackend()
    return TorchRefBackend()
