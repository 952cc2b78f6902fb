"""Choose the attention backend for a device."""
from __future__ import annotations

import torch

from dabba.attention.backend import AttentionBackend
from dabba.attention.cpu import CpuBackend
from dabba.attention.torch_ref import TorchRefBackend
from dabba import native

BACKENDS = ("auto", "torch_ref", "cpu")


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """"auto": the native CPU backend on CPU when its kernel builds, else the reference."""
    if name == "torch_ref":
        return TorchRefBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' needs device cpu, not {device.type}")
        if not native.load_cpu_ops():
            raise ValueError("attention_backend='cpu' but its kernel could not be built (see the log)")
        return CpuBackend()
    if device.type == "cpu" and native.load_cpu_ops():
        return CpuBackend()
    return TorchRefBackend()
