"""Linear layers whose weights may arrive as several checkpoint tensors (q/k/v, gate/up), and
may be one rank's shard of a tensor-parallel layer."""
from __future__ import annotations

import torch
from torch import nn

from dabba.distributed.tensor_parallel import current_tensor_parallel
from dabba.layers.lora import LoRASlots, step_has_adapters
from dabba.ops.activation import act_and_mul as apply_act_and_mul
from dabba.quantization.base import UnquantizedLinearMethod
from dabba.quantization.config import QuantConfig

PARALLEL_KINDS = (None, "column", "row")


class Linear(nn.Module):
    """y = x W^T + b, with W stored [out_features, in_features] as in the checkpoint.

    A merged layer lists ``output_sizes`` and ``shard_ids``: the checkpoint's separate tensors
    (say q_proj, k_proj, v_proj) are copied into consecutive row ranges of one weight, so one
    GEMM serves them all. ``prefix`` is the layer's checkpoint name, for per-layer decisions.
    With a ``quant_config`` the layer's method repacks the loaded weight once
    (process_weights_after_loading) and computes every forward from the packed form.

    Tensor parallelism (Megatron's split, over the group current at construction): ``parallel``
    "column" keeps this rank's rows of each merged shard, by default an equal part; where the
    caller says, ``output_slices`` name them per shard as (start, size) in the checkpoint tensor
    (KV heads replicated on several ranks). "row" keeps this rank's part of the input channels,
    and the partial products are summed over the group (unless ``reduce_results`` is False: the
    caller sums several layers' at once) before the bias is added. A quantized row-parallel
    layer's shard must hold whole groups. The ``full_*`` sizes are the checkpoint's; the others
    this rank's::

        column: out = output_sizes (this rank's slices)   in = full_in_features
        row:    out = full output_sizes                   in = full_in_features / size, from input_offset
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        shard_ids: tuple | None = None,
        prefix: str = "",
        quant_config: QuantConfig | None = None,
        parallel: str | None = None,
        output_slices: list[tuple[int, int]] | None = None,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        if parallel not in PARALLEL_KINDS:
            raise ValueError(f"{prefix}: parallel must be one of {PARALLEL_KINDS}, got {parallel!r}")
        tp = current_tensor_parallel()
        self.tp = tp
        self.parallel = parallel if tp.size > 1 else None
        self.reduce_results = reduce_results
        self.full_in_features = in_features
        self.full_output_sizes = list(output_sizes)
        self.input_offset = 0
        if self.parallel == "column":
            self.output_slices = output_slices or [(tp.rank * tp.split(n, f"{prefix}'s outputs"), n // tp.size)
                                                   for n in output_sizes]
        else:
            self.output_slices = [(0, n) for n in output_sizes]
        if self.parallel == "row":
            in_features = tp.split(in_features, f"{prefix}'s inputs")
            self.input_offset = tp.rank * in_features
        self.in_features = in_features
        self.output_sizes = [size for _, size in self.output_slices]
        self.out_features = sum(self.output_sizes)
        self.shard_ids = shard_ids
        self.prefix = prefix
        self.quant_method = quant_config.get_linear_method(self) if quant_config else UnquantizedLinearMethod()
        group = getattr(self.quant_method, "group_size", None)
        if self.parallel == "row" and group and (self.in_features % group or self.input_offset % group):
            raise ValueError(f"{prefix}: tensor_parallel_size={tp.size} puts a shard boundary inside a quantization "
                             f"group ({in_features} of {self.full_in_features} input channels a rank, groups of "
                             f"{group}); take a size that divides {self.full_in_features // group} groups")
        self.quant_method.create_weights(self)  # `weight`, or a checkpoint format's packed tensors
        self.lora: LoRASlots | None = None  # adapters' slots, where the engine serves LoRA (worker/lora_manager.py)
        if bias:
            if self.parallel == "row" and not reduce_results:
                raise ValueError(f"{prefix}: a row-parallel layer whose caller sums the ranks cannot add a bias")
            self.add_param("bias", torch.empty(self.out_features))
        else:
            self.register_parameter("bias", None)

    def add_param(self, name: str, tensor: torch.Tensor, output_dim: int | None = 0, output_pack: int = 1,
                  input_dim: int | None = None, input_pack: int = 1) -> None:
        """A loadable tensor; ``output_dim`` is the axis holding outputs (None: not split across
        merged shards), ``output_pack`` how many outputs one element along it packs; ``input_dim``
        and ``input_pack`` the same for input channels (a row-parallel rank keeps its part)."""
        param = nn.Parameter(tensor, requires_grad=False)
        param.weight_loader = self.weight_loader
        param.output_dim, param.output_pack = output_dim, output_pack
        param.input_dim, param.input_pack = input_dim, input_pack
        self.register_parameter(name, param)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        output_dim = param.output_dim
        if shard_id is not None and output_dim is not None and (self.shard_ids is None or shard_id not in self.shard_ids):
            raise ValueError(f"{self.prefix}: unknown shard {shard_id!r}")
        if self.parallel == "row" and param.input_dim is not None:  # this rank's input channels
            self._check_shape(param, loaded, None)
            self.quant_method.whole_tensor_loaded(self, param, loaded)
            loaded = loaded.narrow(param.input_dim, self.input_offset // param.input_pack,
                                   self.in_features // param.input_pack)
        if output_dim is None and shard_id is not None:  # shared by every shard (GPTQ's g_idx)
            loaded_by = getattr(param, "loaded_by", set())
            if loaded_by and not torch.equal(param.data, loaded.to(param.dtype)):
                raise ValueError(f"{self.prefix}: shards {sorted(map(str, loaded_by))} and {shard_id!r} disagree "
                                 "on a tensor they must share")
            param.loaded_by = loaded_by | {shard_id}
        if output_dim is None:
            self._copy(param.data, loaded)
        elif shard_id is None and self.shard_ids:  # a fused checkpoint tensor fills every shard
            self._check_shape(param, loaded, None)
            start = 0
            for idx, size in enumerate(self.full_output_sizes):
                self._copy_output_shard(param, loaded.narrow(output_dim, start // param.output_pack,
                                                             size // param.output_pack), idx)
                start += size
        else:
            self._copy_output_shard(param, loaded, 0 if shard_id is None else self.shard_ids.index(shard_id))

    def _copy_output_shard(self, param: nn.Parameter, loaded: torch.Tensor, idx: int) -> None:
        """Merged shard ``idx`` (the checkpoint's whole tensor for it) into its rows of ``param``:
        this rank's slice of it."""
        dim, pack = param.output_dim, param.output_pack
        (start, size), offset = self.output_slices[idx], sum(self.output_sizes[:idx])
        if start % pack or size % pack or offset % pack:
            raise ValueError(f"{self.prefix}: shard {self.shard_ids[idx] if self.shard_ids else idx!r} does not "
                             f"align with the packing of {pack}")
        if self.parallel == "column":
            self._check_shape(param, loaded, idx)
            loaded = loaded.narrow(dim, start // pack, size // pack)
        self._copy(param.data.narrow(dim, offset // pack, size // pack), loaded)

    def _check_shape(self, param: nn.Parameter, loaded: torch.Tensor, idx: int | None) -> None:
        """Before a rank cuts its part: is ``loaded`` the checkpoint's whole tensor (of merged
        shard ``idx``; None: of the whole layer)?"""
        expected = list(param.shape)
        if param.output_dim is not None:
            full = self.full_output_sizes[idx] if idx is not None else sum(self.full_output_sizes)
            expected[param.output_dim] = full // param.output_pack
        if param.input_dim is not None:
            expected[param.input_dim] = self.full_in_features // param.input_pack
        if list(loaded.shape) != expected:
            raise ValueError(f"{self.prefix}: checkpoint tensor {tuple(loaded.shape)} != expected {tuple(expected)}")

    def _copy(self, target: torch.Tensor, loaded: torch.Tensor) -> None:
        if target.shape != loaded.shape:
            raise ValueError(f"{self.prefix}: checkpoint tensor {tuple(loaded.shape)} != expected {tuple(target.shape)}")
        target.copy_(loaded)

    def forward(self, x: torch.Tensor, act_and_mul: str | None = None) -> torch.Tensor:
        """x W^T + b; with ``act_and_mul`` ("silu": SwiGLU, "gelu_tanh": GeGLU), act(gate) * up of a
        merged [gate, up] layer's output, fused where the method can. (Through the module call
        either way: calibration hooks see x.)"""
        if self.lora is not None and step_has_adapters():  # the adapters' products join before the activation
            y = self.lora.add_to(self._plain(x), x)
            return y if act_and_mul is None else apply_act_and_mul(y, act_and_mul)
        if act_and_mul is not None:
            return self.quant_method.apply_act_and_mul(self, x, self.bias, act_and_mul)
        return self._plain(x)

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel != "row":
            return self.quant_method.apply(self, x, self.bias)
        y = self.quant_method.apply(self, x, None)  # this rank's partial sums: the bias is added once, after
        if self.reduce_results:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        parallel = f", {self.parallel}-parallel rank {self.tp.rank} of {self.tp.size}" if self.parallel else ""
        return f"in={self.in_features}, out={self.output_sizes}, bias={self.bias is not None}{parallel}"
