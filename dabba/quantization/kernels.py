"""PyTorch's int4 CPU kernel ("tinygemm", ``_weight_int4pack_mm_for_cpu``) as every 4-bit method
uses it: load-time RTN (rtn.py) and GPTQ/AWQ checkpoints (gptq_format.py) repack their codes into
its layout once, then share its matmul, its byte count and its native-loop operands."""
from __future__ import annotations

import torch
from torch import nn

from dabba.ops.host_memory import on_huge_pages
from dabba.quantization.base import NativeLinearSpec


def register_int4_for_cpu(layer: nn.Module, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                          dtype: torch.dtype) -> None:
    """codes [out, in] in [0, 16), scale/zero [out, groups] -> PyTorch's int4 CPU ("tinygemm")
    layout. tinygemm computes (q - 8) * scale + zero, so its zero is (8 - z) * s."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    layer.register_buffer("qweight", on_huge_pages(packed), persistent=False)
    scale_zero = torch.stack([scale.float(), (8 - zero).float() * scale.float()], dim=-1)  # [out, groups, 2]
    layer.register_buffer("scales_and_zeros", scale_zero.transpose(0, 1).contiguous().to(dtype), persistent=False)


def int4_bytes(out: int, k: int, group_size: int, dtype: torch.dtype, device_type: str) -> int:
    """CPU: tinygemm's [out, in / 2] bytes plus (scale, zero) pairs per group in ``dtype``;
    elsewhere one byte per code plus a scale in ``dtype`` and a byte zero per group."""
    groups = k // group_size
    if device_type == "cpu":
        return out * k // 2 + groups * out * 2 * dtype.itemsize
    return out * k + groups * out * (dtype.itemsize + 1)


def int4_matmul_cpu(layer: nn.Module, x: torch.Tensor, group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
    """dabba's INT4 GEMV for decode's few rows (csrc/int4_linear_cpu.cpp reads this layout at close to
    memory bandwidth), tinygemm beyond; tinygemm alone without the native kernels."""
    from dabba.ops.native import load_cpu_ops

    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if load_cpu_ops():
        y = torch.ops.dabba_cpu.int4_linear(x2, layer.qweight, group_size, layer.scales_and_zeros, bias)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, layer.qweight, group_size, layer.scales_and_zeros)
        if bias is not None:
            y = y + bias
    return y.view(*shape[:-1], -1)


def int4_native_spec(layer: nn.Module, group_size: int) -> NativeLinearSpec | None:
    """The int4 CPU kernel's operands, where the layer was packed for it (int4_matmul_cpu)."""
    if getattr(layer, "scales_and_zeros", None) is None:
        return None
    return NativeLinearSpec("int4", layer.qweight, layer.scales_and_zeros, group_size)
