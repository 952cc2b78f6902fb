"""Choose the attention backend for a device."""
from __future__ import annotations

import torch

from dabba.attention.backend import AttentionBackend
from dabba.attention.cpu import CpuBackend
from dabba.attention.kv_quant import KVQuant
from dabba.attention.torch_ref import TorchRefBackend
from dabba.ops import native

BACKENDS = ("auto", "torch_ref", "cpu")


def get_attention_backend(name: str, device: torch.device, kv_quant: KVQuant | None = None) -> AttentionBackend:
    """"auto": the native CPU backend on CPU when its kernels build, else the reference. Both read
    full-precision and 8-bit KV caches (``kv_quant``): the native kernels attend the codes in place."""
    if name == "torch_ref":
        return TorchRefBackend(kv_quant)
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' needs device cpu, not {device.type}")
        if not native.load_cpu_ops():
            raise ValueError("attention_backend='cpu' but its kernel could not be built (see the log)")
        return CpuBackend(kv_quant)
    if device.type == "cpu" and native.load_cpu_ops():
        return CpuBackend(kv_quant)
    return TorchRefBackend(kv_quant)
