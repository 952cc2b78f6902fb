"""The per-layer quantization interface (the model's QuantConfig, in config.py, hands each layer its
method).

The method owns the layer's weight format: ``process_weights_after_loading`` turns the checkpoint's
weight into the kernel's layout once, ``apply`` computes x W^T + b every forward, and
``native_spec`` says how the native layer loop computes the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from dabba.ops import native
from dabba.ops.activation import act_and_mul

class LinearMethod:
    # Whether a tied embedding can look its rows up in what process_weights_after_loading keeps
    # (embedding_rows), so the vocabulary is held once: known before loading, for the planner.
    packs_embedding_rows: bool = False

    def create_weights(self, layer: nn.Module) -> None:
        """The tensors the checkpoint provides: a full-precision weight unless a format says otherwise."""
        layer.add_param("weight", torch.empty(layer.out_features, layer.in_features), input_dim=1)

    def whole_tensor_loaded(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """A row-parallel layer's checkpoint tensor, before the rank keeps its channels: for a
        method whose groups span the whole row (per-channel INT8)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def packed_bytes(self, layer: nn.Module, dtype: torch.dtype, device_type: str) -> int:
        """Bytes of the weight once process_weights_after_loading ran (bias excluded): what the
        memory planner counts without loading anything."""
        return layer.out_features * layer.in_features * dtype.itemsize

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def apply_act_and_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                          activation: str) -> torch.Tensor:
        """A gated MLP's merged gate_up layer: ``activation``(gate) * up of ``apply``'s output
        ("silu": SwiGLU, "gelu_tanh": GeGLU). A method may fuse the two; the native layer loop does
        what this does for SwiGLU (NativeLinear::silu_and_mul)."""
        return act_and_mul(self.apply(layer, x, bias), activation)

    def embedding_rows(self, layer: nn.Module, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        """ids [T] -> rows [T, in] of the packed weight in ``dtype``, dequantized as ``apply`` reads
        them (a tied LM head's, for its embedding; where ``packs_embedding_rows``); made once."""
        raise NotImplementedError(f"{type(self).__name__} keeps no rows an embedding can read")

    def native_spec(self, layer: nn.Module) -> NativeLinearSpec | None:
        """How the native layer loop (csrc/decode_cpu.cpp) computes what ``apply`` does on the CPU;
        None where it cannot, and the model then runs its layers in Python."""
        return None


@dataclass(frozen=True)
class NativeLinearSpec:
    kind: str  # "dense", "int8", "int4", "gguf", "w8a8", ...: a LinearKind of csrc/cpu_ops.h by name
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    group_size: int = 0
    sums: torch.Tensor | None = None  # W8A8: each channel's codes summed, its zero point's correction


class UnquantizedLinearMethod(LinearMethod):
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return native.linear(x, layer.weight, bias)

    def apply_act_and_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                          activation: str) -> torch.Tensor:
        # fused into dabba's GEMM where it runs (the activation applied as the GEMM stores)
        fused = native.linear_act_and_mul(x, layer.weight, bias, activation)
        return fused if fused is not None else super().apply_act_and_mul(layer, x, bias, activation)

    def native_spec(self, layer: nn.Module) -> NativeLinearSpec | None:
        return NativeLinearSpec("dense", layer.weight)
