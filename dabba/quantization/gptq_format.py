"""Linear layers of pre-quantized checkpoints: GPTQ (AutoGPTQ / GPTQModel, checkpoint_format
"gptq") and AWQ ("gemm", AutoAWQ).

The layer takes the checkpoint's packed tensors as they are (see formats.py), then, once after
loading, unpacks them into PyTorch's int4 CPU kernel layout when the groups are contiguous and
the codes are 4-bit; otherwise (act-order g_idx, 8 bits, not on CPU) it dequantizes to the model
dtype and multiplies densely, which is correct but not memory-saving.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dabba.quantization.base import LinearMethod, NativeLinearSpec
from dabba.quantization.formats import awq_unpack, gptq_unpack
from dabba.quantization.kernels import int4_bytes, int4_matmul_cpu, int4_native_spec, register_int4_for_cpu


class GPTQLinearMethod(LinearMethod):
    def __init__(self, bits: int, group_size: int, desc_act: bool = False) -> None:
        self.bits, self.group_size, self.desc_act = bits, group_size, desc_act
        self.packed = False

    def create_weights(self, layer: nn.Module) -> None:
        out, k = layer.out_features, layer.in_features
        per_word = 32 // self.bits
        if k % self.group_size or k % per_word or out % per_word:
            raise ValueError(f"{layer.prefix}: GPTQ needs in ({k}) divisible by group_size ({self.group_size}) and "
                             f"by {per_word}, and out ({out}) divisible by {per_word}")
        if self.desc_act and getattr(layer, "parallel", None) == "row":
            raise ValueError(f"{layer.prefix}: an act-order GPTQ checkpoint (desc_act) cannot split a layer's input "
                             "channels across tensor-parallel ranks: its groups are not contiguous")
        groups, g = k // self.group_size, self.group_size
        layer.add_param("qweight", torch.empty(k // per_word, out, dtype=torch.int32), output_dim=1,
                        input_dim=0, input_pack=per_word)
        layer.add_param("qzeros", torch.empty(groups, out // per_word, dtype=torch.int32), output_dim=1,
                        output_pack=per_word, input_dim=0, input_pack=g)
        layer.add_param("scales", torch.empty(groups, out), output_dim=1, input_dim=0, input_pack=g)
        layer.add_param("g_idx", torch.empty(k, dtype=torch.int32), output_dim=None, input_dim=0)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        tensors = {name: getattr(layer, name).data for name in ("qweight", "qzeros", "scales", "g_idx")}
        dtype = tensors["scales"].dtype
        codes, zeros, scales, g_idx = gptq_unpack(tensors, self.bits)  # [out, in], [out, groups] x2, [in]
        g_idx = g_idx - getattr(layer, "input_offset", 0) // self.group_size  # a row-parallel rank's groups from 0
        for name in tensors:
            delattr(layer, name)
        contiguous = torch.equal(g_idx.long(), torch.arange(layer.in_features) // self.group_size)
        if self.bits == 4 and contiguous and codes.device.type == "cpu":
            self.packed = True
            register_int4_for_cpu(layer, codes, scales, zeros, dtype)
        else:
            weight = (codes - zeros[:, g_idx.long()]).float() * scales[:, g_idx.long()]
            layer.register_buffer("weight", weight.to(dtype), persistent=False)

    def packed_bytes(self, layer: nn.Module, dtype: torch.dtype, device_type: str) -> int:
        """Assumes contiguous groups unless the checkpoint says act-order (desc_act), whose layers
        are dequantized."""
        if self.bits == 4 and not self.desc_act and device_type == "cpu":
            return int4_bytes(layer.out_features, layer.in_features, self.group_size, dtype, device_type)
        return layer.out_features * layer.in_features * dtype.itemsize

    def native_spec(self, layer: nn.Module) -> NativeLinearSpec | None:
        return int4_native_spec(layer, self.group_size) if self.packed else None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, layer.weight, bias)
        return int4_matmul_cpu(layer, x, self.group_size, bias)


class AWQLinearMethod(LinearMethod):
    """Linear layers of an AWQ "gemm" checkpoint (AutoAWQ): 4-bit codes with zero points, groups
    contiguous by construction, so always the int4 kernel on CPU."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def create_weights(self, layer: nn.Module) -> None:
        out, k = layer.out_features, layer.in_features
        if k % self.group_size or out % 8:
            raise ValueError(f"{layer.prefix}: AWQ needs in ({k}) divisible by group_size ({self.group_size}) "
                             f"and out ({out}) divisible by 8")
        groups, g = k // self.group_size, self.group_size
        layer.add_param("qweight", torch.empty(k, out // 8, dtype=torch.int32), output_dim=1, output_pack=8,
                        input_dim=0)
        layer.add_param("qzeros", torch.empty(groups, out // 8, dtype=torch.int32), output_dim=1, output_pack=8,
                        input_dim=0, input_pack=g)
        layer.add_param("scales", torch.empty(groups, out), output_dim=1, input_dim=0, input_pack=g)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        tensors = {name: getattr(layer, name).data for name in ("qweight", "qzeros", "scales")}
        dtype = tensors["scales"].dtype
        codes, zeros, scales = awq_unpack(tensors)  # [out, in], [out, groups] x2
        for name in tensors:
            delattr(layer, name)
        if codes.device.type == "cpu":
            register_int4_for_cpu(layer, codes, scales, zeros, dtype)
        else:
            g = torch.arange(layer.in_features, device=codes.device) // self.group_size
            layer.register_buffer("weight", ((codes - zeros[:, g]).float() * scales[:, g]).to(dtype), persistent=False)

    def packed_bytes(self, layer: nn.Module, dtype: torch.dtype, device_type: str) -> int:
        if device_type == "cpu":
            return int4_bytes(layer.out_features, layer.in_features, self.group_size, dtype, device_type)
        return layer.out_features * layer.in_features * dtype.itemsize

    def native_spec(self, layer: nn.Module) -> NativeLinearSpec | None:
        return int4_native_spec(layer, self.group_size)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.device.type != "cpu":
            return F.linear(x, layer.weight, bias)
        return int4_matmul_cpu(layer, x, self.group_size, bias)
