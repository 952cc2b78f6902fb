"""How many bytes a model's weights take, from its config alone: the planner's arithmetic, and the
check that refuses a model that cannot fit before anything is allocated."""
from __future__ import annotations

import torch

from dabba.arch.config import ArchConfig
from dabba.distributed.tensor_parallel import TensorParallel, building_for
from dabba.layers.embedding import LMHead, VocabEmbedding
from dabba.layers.fused_moe import Expert
from dabba.layers.linear import Linear
from dabba.models.registry import model_class_for
from dabba.quantization.config import QuantConfig


def meta_model(arch: ArchConfig, dtype: torch.dtype, quant_config: QuantConfig | None,
               tp_size: int = 1) -> torch.nn.Module:
    """The model (rank 0's shard of it under tensor parallelism) built on the meta device: no
    memory, no loading."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"), building_for(TensorParallel(0, tp_size)):
            return model_class_for(arch)(arch, 16, quant_config)
    finally:
        torch.set_default_dtype(previous)


def weights_bytes(arch: ArchConfig, dtype: torch.dtype, quant_config: QuantConfig | None,
                  device_type: str = "cpu", active: bool = False, tp_size: int = 1) -> int:
    """Every parameter at ``dtype`` except each linear's weight, counted as its method packs it.
    ``active``: only what one token's forward multiplies (a mixture of experts' routed layers
    count top_k of their experts). ``tp_size``: what one rank of that many holds."""
    model = meta_model(arch, dtype, quant_config, tp_size)
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
        packed = (quant_config.embedding_bytes(module.shard.num_rows, module.weight.shape[1])
                  if isinstance(module, VocabEmbedding) and quant_config is not None else None)
        if packed is not None and id(module.weight) not in seen:  # a GGUF file's blocks
            seen.add(id(module.weight))
            total += packed
            continue
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                total += param.numel() * dtype.itemsize
    if active and arch.moe is not None:
        expert = next(m for m in model.modules() if isinstance(m, Expert))
        per_expert = sum(lin.quant_method.packed_bytes(lin, dtype, device_type)
                         for lin in (expert.gate_up_proj, expert.down_proj))
        total -= sum(arch.moe.sparse_layers) * (arch.moe.num_experts - arch.moe.top_k) * per_expert
    return total


def parameter_counts(arch: ArchConfig) -> tuple[int, int]:
    """(every parameter, those one token's forward multiplies): all of them, less in each routed
    layer the experts a token does not take (num_experts - top_k of them)."""
    total = sum(p.numel() for p in meta_model(arch, torch.get_default_dtype(), None).parameters())  # tied head once
    return total, total - idle_expert_parameters(arch)


def idle_expert_parameters(arch: ArchConfig) -> int:
    """Weights of the experts one token does not take (num_experts - top_k per routed layer); 0
    for a dense model."""
    if arch.moe is None:
        return 0
    per_expert = 3 * arch.hidden_size * arch.moe.intermediate_size  # gate, up, down
    return sum(arch.moe.sparse_layers) * (arch.moe.num_experts - arch.moe.top_k) * per_expert
