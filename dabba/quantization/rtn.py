"""Round-to-nearest quantization: the formulas, and the INT8/INT4 linear methods.

    scale s = (r_max - r_min) / (2^b - 1)
    asymmetric: zero z = round(-r_min / s), q = clamp(round(w / s) + z, 0, 2^b - 1), w ~ (q - z) * s
    symmetric:  r_min = -r_max = -max|w|,   q = clamp(round(w / s), -2^(b-1), 2^(b-1) - 1), w ~ q * s

On CPU the methods use PyTorch's weight-packed kernels (``_weight_int8pack_mm`` and the int4
"tinygemm" ``_weight_int4pack_mm_for_cpu``); INT8 takes dabba's own kernels, which read the same
codes: the GEMV for decode's few rows (csrc/int8_gemv_cpu.cpp), the GEMM on codes widened to bf16
for batches (csrc/gemm_cpu.cpp), and for long prefills a bf16 linear on codes dequantized per call.
Elsewhere they dequantize and multiply.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dabba.ops import native
from dabba.ops.host_memory import on_huge_pages
from dabba.quantization.base import LinearMethod, NativeLinearSpec
from dabba.quantization.kernels import int4_bytes, int4_matmul_cpu, int4_native_spec, register_int4_for_cpu


@dataclass
class QuantizedWeight:
    q: torch.Tensor  # [out, in] integer codes (int32; quantize_rows: the dtype asked for)
    scale: torch.Tensor  # [out, in / group_size] float32
    zero: torch.Tensor  # [out, in / group_size] int32 (0 when symmetric)
    group_size: int

    def dequantize(self) -> torch.Tensor:
        out, k = self.q.shape
        g = self.group_size
        w = (self.q.view(out, k // g, g) - self.zero[..., None]).float() * self.scale[..., None]
        return w.view(out, k)


def quantize(w: torch.Tensor, bits: int, group_size: int, symmetric: bool,
             r_max: torch.Tensor | None = None) -> QuantizedWeight:
    """w: [out, in] -> codes per group of ``group_size`` input channels (group_size = in: per channel).
    ``r_max`` [out, in / group_size]: symmetric groups' range where w is part of a wider row (a
    row-parallel rank's channels, scaled as the whole row is)."""
    out, k = w.shape
    if k % group_size:
        raise ValueError(f"in_features ({k}) must be a multiple of group_size ({group_size})")
    wg = w.float().view(out, k // group_size, group_size)
    if symmetric:
        r_max = wg.abs().amax(-1) if r_max is None else r_max
        scale = (2 * r_max / (2**bits - 1)).clamp(min=1e-10)
        zero = torch.zeros_like(scale, dtype=torch.int32)
        q = torch.clamp(torch.round(wg / scale[..., None]), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    else:
        r_min, r_max = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)  # keep 0 exactly representable
        scale = ((r_max - r_min) / (2**bits - 1)).clamp(min=1e-10)
        zero = torch.round(-r_min / scale).to(torch.int32)
        q = torch.clamp(torch.round(wg / scale[..., None]) + zero[..., None], 0, 2**bits - 1)
    return QuantizedWeight(q.to(torch.int32).view(out, k), scale, zero, group_size)


QUANTIZE_BLOCK_ELEMENTS = 2**22  # weight elements quantize_rows hands quantize at once


def quantize_rows(w: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                  codes_dtype: torch.dtype, r_max: torch.Tensor | None = None) -> QuantizedWeight:
    """quantize() a block of rows at a time, storing the codes as ``codes_dtype``. quantize makes
    several float32 temporaries of the weight's size at once: over a 150k-row LM head that was
    gigabytes, more than the whole bf16 model's load. Rows are independent: the same codes."""
    out, k = w.shape
    rows = max(1, QUANTIZE_BLOCK_ELEMENTS // k)
    q = torch.empty(out, k, dtype=codes_dtype, device=w.device)
    scale = torch.empty(out, k // group_size, dtype=torch.float32, device=w.device)
    zero = torch.empty(out, k // group_size, dtype=torch.int32, device=w.device)
    for start in range(0, out, rows):
        part = quantize(w[start:start + rows], bits, group_size, symmetric,
                        None if r_max is None else r_max[start:start + rows])
        q[start:start + rows], scale[start:start + rows], zero[start:start + rows] = part.q, part.scale, part.zero
    return QuantizedWeight(q, scale, zero, group_size)


def _drop_weight(layer: nn.Module) -> None:
    del layer.weight
    layer.register_parameter("weight", None)


class Int8RTNMethod(LinearMethod):
    """Symmetric INT8, one scale per output channel: of the whole row, also where a row-parallel
    rank holds only part of it (whole_tensor_loaded), so every tensor-parallel size computes
    with the same codes."""

    packs_embedding_rows = True

    def whole_tensor_loaded(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param is layer.weight:
            layer.row_absmax = loaded.to(param.dtype).float().abs().amax(dim=1, keepdim=True)  # [out, 1]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data
        qw = quantize_rows(w, 8, w.shape[1], symmetric=True, codes_dtype=torch.int8,
                           r_max=getattr(layer, "row_absmax", None))
        _drop_weight(layer)
        layer.register_buffer("qweight", on_huge_pages(qw.q), persistent=False)  # [out, in]
        layer.register_buffer("scales", qw.scale[:, 0].to(w.dtype), persistent=False)  # [out]

    def packed_bytes(self, layer: nn.Module, dtype: torch.dtype, device_type: str) -> int:
        return layer.out_features * layer.in_features + layer.out_features * dtype.itemsize

    def native_spec(self, layer: nn.Module) -> NativeLinearSpec | None:
        return NativeLinearSpec("int8", layer.qweight, layer.scales)

    def embedding_rows(self, layer: nn.Module, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        codes, scales = layer.qweight, layer.scales
        return lambda ids: (F.embedding(ids, codes).to(scales.dtype) * scales[ids, None]).to(dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x.device.type == "cpu":
            y = native.int8_linear(x2, layer.qweight, layer.scales, bias)  # dabba's kernels pick
            if y is not None:
                return y.view(*shape[:-1], -1)
            y = torch.ops.aten._weight_int8pack_mm(x2, layer.qweight, layer.scales)
        else:
            y = F.linear(x2, layer.qweight.to(x.dtype) * layer.scales[:, None])
        if bias is not None:
            y = y + bias
        return y.view(*shape[:-1], -1)


class Int4RTNMethod(LinearMethod):
    """Asymmetric INT4 with integer zero points, one (scale, zero) per group of input channels."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data
        qw = quantize_rows(w, 4, self.group_size, symmetric=False, codes_dtype=torch.uint8)
        _drop_weight(layer)
        if w.device.type == "cpu":
            register_int4_for_cpu(layer, qw.q, qw.scale, qw.zero, w.dtype)
        else:
            layer.register_buffer("qweight", qw.q, persistent=False)
            layer.register_buffer("scales", qw.scale.to(w.dtype), persistent=False)
            layer.register_buffer("zeros", qw.zero.to(torch.uint8), persistent=False)

    def packed_bytes(self, layer: nn.Module, dtype: torch.dtype, device_type: str) -> int:
        return int4_bytes(layer.out_features, layer.in_features, self.group_size, dtype, device_type)

    def native_spec(self, layer: nn.Module) -> NativeLinearSpec | None:
        return int4_native_spec(layer, self.group_size)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.device.type == "cpu":
            return int4_matmul_cpu(layer, x, self.group_size, bias)
        out, k = layer.qweight.shape
        g = self.group_size
        w = (layer.qweight.view(out, k // g, g).to(x.dtype) - layer.zeros[..., None].to(x.dtype)) * layer.scales[..., None]
        return F.linear(x, w.view(out, k), bias)
