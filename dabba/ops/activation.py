"""Gated MLP activations on a merged gate_up projection: act(gate) * up, with act SiLU (SwiGLU:
Llama, Qwen, Mistral, Phi-3) or GELU's tanh approximation (GeGLU: Gemma's gelu_pytorch_tanh)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dabba.ops import native

ACTIVATIONS = ("silu", "gelu_tanh")  # ArchConfig.mlp_activation's values


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * intermediate] = gate | up  ->  silu(gate) * up."""
    if native.native_rows(x):
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
        torch.ops.dabba_cpu.silu_and_mul(out, x)
        return out
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * intermediate] = gate | up  ->  gelu(gate, approximate="tanh") * up,
    rounded where transformers' act_fn(gate_proj(x)) * up_proj(x) rounds (the kernel's gelu
    agrees with PyTorch's within float32 rounding, not bit for bit)."""
    if native.native_rows(x):
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
        torch.ops.dabba_cpu.gelu_tanh_and_mul(out, x)
        return out
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """``activation``(gate) * up of a merged [gate | up] projection's output."""
    if activation == "silu":
        return silu_and_mul(x)
    if activation == "gelu_tanh":
        return gelu_tanh_and_mul(x)
    raise ValueError(f"unknown MLP activation {activation!r}; supported: {ACTIVATIONS}")
