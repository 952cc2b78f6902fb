"""W8A8 for plain nn.Linear modules: an image encoder's linears, when asked (by default a vision
tower keeps the model's dtype whatever --quantization says). The same codes as load-time W8A8
(symmetric INT8 per output channel) and the same kernels (activations rounded per row at run
time, multiplied in integers), without the LinearMethod machinery the language model's layers
carry for tensor parallelism and checkpoints."""
from __future__ import annotations

import torch
from torch import nn

from dabba.ops import native
from dabba.ops.host_memory import on_huge_pages
from dabba.quantization.w8a8 import pack_weight, packing, w8a8_linear, w8a8_reference


class W8A8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        from dabba.quantization.rtn import quantize_rows

        super().__init__()
        w = linear.weight.data
        _, _, max_inputs = packing()
        if w.shape[1] > max_inputs:
            raise ValueError(f"W8A8 takes at most {max_inputs} inputs, a linear has {w.shape[1]}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        qw = quantize_rows(w, 8, w.shape[1], symmetric=True, codes_dtype=torch.int8)
        codes = qw.q
        self.register_buffer("scales", qw.scale[:, 0].float().contiguous(), persistent=False)
        self.register_buffer("wsum", codes.to(torch.int32).sum(dim=1, dtype=torch.int32), persistent=False)
        on_cpu = codes.device.type == "cpu"
        self.register_buffer("packed", on_huge_pages(pack_weight(codes)) if on_cpu else None, persistent=False)
        self.register_buffer("codes", None if on_cpu else codes, persistent=False)  # the reference's operand
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        if self.packed is not None and native.load_cpu_ops() and x2.dtype in (torch.bfloat16, torch.float32):
            y = w8a8_linear(x2, self.packed, self.wsum, self.scales, self.bias, False)
        else:
            y = w8a8_reference(x2, self.codes, self.scales, self.bias, False)
        return y.view(*shape[:-1], -1)


def w8a8_linears(module: nn.Module) -> int:
    """Every plain nn.Linear under ``module`` replaced by its W8A8 form; how many."""
    count = 0
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            setattr(module, name, W8A8Linear(child))
            count += 1
        else:
            count += w8a8_linears(child)
    return count
