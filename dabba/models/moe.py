"""Mixture-of-experts families: Mixtral (8 experts, top-2), Qwen3-MoE (many experts, per-head q/k
norms, optional dense layers) and OLMoE (q/k norms over the whole projection, 64 experts, top-8).
Each is the Llama block with its MLP replaced by dabba.layers.moe.FusedMoE where the config routes.

Checkpoint names: Mixtral's ``block_sparse_moe`` is dabba's ``mlp``; each expert's gate/up/down
(``w1``/``w3``/``w2`` in Mixtral) fills its slice of the stacked ``w13_weight``/``w2_weight``, as
do transformers 5's already stacked ``experts.gate_up_proj`` and ``experts.down_proj``.
"""
from __future__ import annotations

import re
from typing import Hashable

import torch
from torch import nn

from dabba.layers.layernorm import RMSNorm
from dabba.layers.moe import FusedMoE
from dabba.models.config import ArchConfig
from dabba.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, checkpoint_target
from dabba.models.qwen3 import Qwen3Attention
from dabba.quantization.config import QuantConfig

# layers.{i}.(mlp|block_sparse_moe).experts.{e}.{projection}.weight -> (stacked parameter, part of it)
EXPERT_TENSOR = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
EXPERT_PART = {"gate_proj": ("w13_weight", 0), "w1": ("w13_weight", 0), "up_proj": ("w13_weight", 1),
               "w3": ("w13_weight", 1), "down_proj": ("w2_weight", None), "w2": ("w2_weight", None)}
# transformers 5 stacks them itself: [experts, 2 * intermediate, hidden] (gate rows, then up) and [experts, hidden, intermediate]
STACKED_TENSOR = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")


def moe_checkpoint_target(name: str) -> tuple[str, Hashable]:
    """A MoE checkpoint tensor's parameter name and shard id; everything else as the Llama family's."""
    if m := EXPERT_TENSOR.match(name):
        param, part = EXPERT_PART[m.group(3)]
        return f"{m.group(1)}.mlp.{param}", (int(m.group(2)), part)
    if m := STACKED_TENSOR.match(name):
        return f"{m.group(1)}.mlp.{'w13_weight' if m.group(2) == 'gate_up_proj' else 'w2_weight'}", None
    return checkpoint_target(name.replace(".block_sparse_moe.", ".mlp."))


class OlmoeAttention(LlamaAttention):
    """RMSNorm over all of q's heads at once, and over all of k's, before RoPE."""

    def __init__(self, cfg: ArchConfig, layer_idx: int, prefix: str, quant_config: QuantConfig | None) -> None:
        super().__init__(cfg, layer_idx, prefix, quant_config)
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q.reshape(q.shape[0], -1)).view_as(q), self.k_norm(k.reshape(k.shape[0], -1)).view_as(k)


class MoEDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, cfg: ArchConfig, layer_idx: int, prefix: str, quant_config: QuantConfig | None) -> nn.Module:
        if cfg.moe is None or not cfg.moe.sparse_layers[layer_idx]:
            return LlamaMLP(cfg, prefix, quant_config)
        return FusedMoE(cfg.hidden_size, cfg.moe, cfg.mlp_activation, prefix)


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    attention_cls = Qwen3Attention


class OlmoeDecoderLayer(MoEDecoderLayer):
    attention_cls = OlmoeAttention


class MoEForCausalLM(LlamaForCausalLM):
    layer_cls = MoEDecoderLayer

    def __init__(self, cfg: ArchConfig, max_position: int, quant_config: QuantConfig | None = None) -> None:
        if quant_config is not None:
            raise ValueError(f"quantization ({quant_config.method}) of mixture-of-experts models "
                             f"({cfg.architecture}) is not supported yet: load it unquantized")
        super().__init__(cfg, max_position, quant_config)

    def checkpoint_target(self, name: str) -> tuple[str, Hashable]:
        return moe_checkpoint_target(name)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer


class OlmoeForCausalLM(MoEForCausalLM):
    layer_cls = OlmoeDecoderLayer
