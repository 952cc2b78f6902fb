"""The per-layer quantization interface, and the config that hands a method to each layer.

A Linear layer asks the model's QuantConfig for its method. The method owns the layer's
weight format: ``process_weights_after_loading`` turns the checkpoint's weight into the
kernel's layout once, ``apply`` computes x W^T + b every forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATION_METHODS = ("int8", "int4")


class LinearMethod:
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


@dataclass(frozen=True)
class QuantConfig:
    """Round-to-nearest weight-only quantization applied at load time.

    int8: symmetric, per output channel. int4: asymmetric with an integer zero point, per group
    of ``group_size`` input channels (64 or 32 for a layer whose width the group does not tile).
    Scale s = (r_max - r_min) / (2^bits - 1).
    """

    method: str
    group_size: int = 128

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} or None, got {self.method!r}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")

    def get_linear_method(self, layer: nn.Module) -> LinearMethod:
        from dabba.quantization.rtn import Int4RTNMethod, Int8RTNMethod

        if self.method == "int8":
            return Int8RTNMethod()
        # Groups must tile the layer's input width (SmolLM's 576 is not a multiple of 128):
        # fall back to smaller groups, or leave the layer unquantized.
        for group_size in (self.group_size, 64, 32):
            if layer.in_features % group_size == 0 and group_size <= self.group_size:
                return Int4RTNMethod(group_size)
        return UnquantizedLinearMethod()
