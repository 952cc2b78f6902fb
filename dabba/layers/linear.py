"""Linear layers whose weights may arrive as several checkpoint tensors (q/k/v, gate/up)."""
from __future__ import annotations

import torch
from torch import nn

from dabba.quantization.base import UnquantizedLinearMethod
from dabba.quantization.config import QuantConfig


class Linear(nn.Module):
    """y = x W^T + b, with W stored [out_features, in_features] as in the checkpoint.

    A merged layer lists ``output_sizes`` and ``shard_ids``: the checkpoint's separate tensors
    (say q_proj, k_proj, v_proj) are copied into consecutive row ranges of one weight, so one
    GEMM serves them all. ``prefix`` is the layer's checkpoint name, for per-layer decisions.
    With a ``quant_config`` the layer's method repacks the loaded weight once
    (process_weights_after_loading) and computes every forward from the packed form.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        shard_ids: tuple | None = None,
        prefix: str = "",
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.shard_ids = shard_ids
        self.prefix = prefix
        self.quant_method = quant_config.get_linear_method(self) if quant_config else UnquantizedLinearMethod()
        self.quant_method.create_weights(self)  # `weight`, or a checkpoint format's packed tensors
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def add_param(self, name: str, tensor: torch.Tensor, output_dim: int | None = 0, output_pack: int = 1) -> None:
        """A loadable tensor; ``output_dim`` is the axis holding outputs (None: not split across
        merged shards), ``output_pack`` how many outputs one element along it packs."""
        param = nn.Parameter(tensor, requires_grad=False)
        param.weight_loader = self.weight_loader
        param.output_dim, param.output_pack = output_dim, output_pack
        self.register_parameter(name, param)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        output_dim = getattr(param, "output_dim", 0)
        if output_dim is None and shard_id is not None:  # shared by every shard (GPTQ's g_idx)
            loaded_by = getattr(param, "loaded_by", set())
            if loaded_by and not torch.equal(param.data, loaded.to(param.dtype)):
                raise ValueError(f"{self.prefix}: shards {sorted(map(str, loaded_by))} and {shard_id!r} disagree "
                                 "on a tensor they must share")
            param.loaded_by = loaded_by | {shard_id}
        if shard_id is None or output_dim is None:
            target = param.data
        else:
            if self.shard_ids is None or shard_id not in self.shard_ids:
                raise ValueError(f"{self.prefix}: unknown shard {shard_id!r}")
            idx = self.shard_ids.index(shard_id)
            pack = getattr(param, "output_pack", 1)
            start, size = sum(self.output_sizes[:idx]), self.output_sizes[idx]
            if start % pack or size % pack:
                raise ValueError(f"{self.prefix}: shard {shard_id!r} does not align with the packing of {pack}")
            target = param.data.narrow(output_dim, start // pack, size // pack)
        if target.shape != loaded.shape:
            raise ValueError(f"{self.prefix}: checkpoint tensor {tuple(loaded.shape)} != expected {tuple(target.shape)}")
        target.copy_(loaded)

    def forward(self, x: torch.Tensor, act_and_mul: str | None = None) -> torch.Tensor:
        """x W^T + b; with ``act_and_mul`` ("silu": SwiGLU, "gelu_tanh": GeGLU), act(gate) * up of a
        merged [gate, up] layer's output, fused where the method can. (Through the module call
        either way: calibration hooks see x.)"""
        if act_and_mul is not None:
            return self.quant_method.apply_act_and_mul(self, x, self.bias, act_and_mul)
        return self.quant_method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.output_sizes}, bias={self.bias is not None}"
