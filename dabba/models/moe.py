"""Mixture-of-experts families: Mixtral (8 experts, top-2), Qwen3-MoE (many experts, per-head q/k
norms, optional dense layers) and OLMoE (q/k norms over the whole projection, 64 experts, top-8).
Each is the Llama block with its MLP replaced by dabba.layers.fused_moe.FusedMoE where the config routes.

Checkpoint names: Mixtral's ``block_sparse_moe`` is dabba's ``mlp`` and its experts' ``w1``/``w3``/
``w2`` are ``gate_proj``/``up_proj``/``down_proj``, which then merge as the dense MLP's do. A
checkpoint that stacks the experts (transformers 5's ``experts.gate_up_proj`` [experts, 2 *
intermediate, hidden] and ``experts.down_proj`` [experts, hidden, intermediate]) is split into
each expert's tensors as it streams in.
"""
from __future__ import annotations

import re
from typing import Callable, Hashable, Iterable, Iterator

import torch
from torch import nn

from dabba.arch.checkpoint_names import checkpoint_target
from dabba.arch.config import ArchConfig
from dabba.distributed.tensor_parallel import current_tensor_parallel
from dabba.layers.fused_moe import FusedMoE
from dabba.layers.layernorm import RMSNorm
from dabba.layers.native_form import NativeQKNorm
from dabba.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from dabba.models.qwen3 import Qwen3Attention
from dabba.quantization.config import QuantConfig

MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w3|w2)\.")
MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
STACKED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def moe_checkpoint_target(name: str) -> tuple[str, Hashable]:
    """A MoE checkpoint tensor's parameter name and shard id, in the Llama family's names."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    name = MIXTRAL_EXPERT.sub(lambda m: f".experts.{m.group(1)}.{MIXTRAL_NAMES[m.group(2)]}.", name)
    return checkpoint_target(name)


def unstack_experts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Stacked expert tensors as each expert's own (a view each: nothing is copied here)."""
    for name, tensor in weights:
        m = STACKED_EXPERTS.match(name)
        if m is None:
            yield name, tensor
            continue
        for e in range(tensor.shape[0]):
            yield f"{m.group(1)}.{e}.{m.group(2)}.weight", tensor[e]


class OlmoeAttention(LlamaAttention):
    """RMSNorm over all of q's heads at once, and over all of k's, before RoPE. Under tensor
    parallelism a rank gathers every rank's heads, normalises them all and keeps its own (so
    the KV heads must divide among the ranks, not be replicated)."""

    def __init__(self, cfg: ArchConfig, layer_idx: int, prefix: str, quant_config: QuantConfig | None) -> None:
        super().__init__(cfg, layer_idx, prefix, quant_config)
        self.tp = current_tensor_parallel()
        if self.tp.size > cfg.num_key_value_heads:
            raise ValueError(f"OLMoE's k norm spans every KV head: tensor_parallel_size={self.tp.size} must divide its "
                             f"{cfg.num_key_value_heads} KV heads")
        self.q_norm = RMSNorm(self.q_size * self.tp.size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size * self.tp.size, cfg.rms_norm_eps)

    def native_qk_norm(self) -> NativeQKNorm:
        return NativeQKNorm(self.q_norm, self.k_norm, whole=True)  # a rank gathers the heads first, as _norm

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._norm(self.q_norm, q), self._norm(self.k_norm, k)

    def _norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(x.shape[0], -1)  # [num_tokens, this rank's heads * head_dim]
        if self.tp.size == 1:
            return norm(flat).view_as(x)
        width = flat.shape[1]
        return norm(self.tp.all_gather(flat))[:, self.tp.rank * width:(self.tp.rank + 1) * width].reshape(x.shape)


class MoEDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, cfg: ArchConfig, layer_idx: int, prefix: str, quant_config: QuantConfig | None) -> nn.Module:
        if cfg.moe is None or not cfg.moe.sparse_layers[layer_idx]:
            return LlamaMLP(cfg, prefix, quant_config)
        return FusedMoE(cfg.hidden_size, cfg.moe, cfg.mlp_activation, prefix, quant_config)


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    attention_cls = Qwen3Attention


class OlmoeDecoderLayer(MoEDecoderLayer):
    attention_cls = OlmoeAttention


class MoEForCausalLM(LlamaForCausalLM):
    layer_cls = MoEDecoderLayer

    def checkpoint_target(self, name: str) -> tuple[str, Hashable]:
        return moe_checkpoint_target(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     on_loaded: Callable[[str, Hashable], None] | None = None) -> None:
        super().load_weights(unstack_experts(weights), on_loaded)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer


class OlmoeForCausalLM(MoEForCausalLM):
    layer_cls = OlmoeDecoderLayer
