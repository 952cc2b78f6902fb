"""How many bytes a model's weights take, from its config alone: the planner's arithmetic, and the
check that refuses a model that cannot fit before anything is allocated."""
from __future__ import annotations

import torch

from dabba.layers.embedding import LMHead
from dabba.layers.linear import Linear
from dabba.models.config import ArchConfig
from dabba.models.registry import get_model_class
from dabba.quantization.config import QuantConfig


def weights_bytes(arch: ArchConfig, dtype: torch.dtype, quant_config: QuantConfig | None,
                  device_type: str = "cpu") -> int:
    """The model built on the meta device (no memory, no loading): every parameter at ``dtype``
    except each linear's weight, counted as its method packs it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = get_model_class(arch.architecture)(arch, 16, quant_config)
    finally:
        torch.set_default_dtype(previous)
    total, seen = 0, set()  # a tied LM head shares the embedding's tensor
    head = getattr(model, "lm_head", None)
    if isinstance(head, LMHead) and head.shares_packed_rows:  # the embedding reads the head's codes
        seen.add(id(head.weight))
    for module in model.modules():
        if isinstance(module, Linear):
            total += module.quant_method.packed_bytes(module, dtype, device_type)
            if module.bias is not None:
                total += module.bias.numel() * dtype.itemsize
            continue
        if isinstance(module, LMHead) and module.quant_method is not None:  # its own packed copy
            total += module.quant_method.packed_bytes(module, dtype, device_type)
            continue
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                total += param.numel() * dtype.itemsize
    return total


def parameter_counts(arch: ArchConfig) -> tuple[int, int]:
    """(every parameter, those one token's forward multiplies): all of them, less in each routed
    layer the experts a token does not take (num_experts - top_k of them)."""
    with torch.device("meta"):
        model = get_model_class(arch.architecture)(arch, 16, None)
    total = sum(p.numel() for p in model.parameters())  # a tied head counted once
    if arch.moe is None:
        return total, total
    per_expert = 3 * arch.hidden_size * arch.moe.intermediate_size  # gate, up, down
    idle = sum(arch.moe.sparse_layers) * (arch.moe.num_experts - arch.moe.top_k) * per_expert
    return total, total - idle
