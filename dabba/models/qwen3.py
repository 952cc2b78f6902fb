"""Qwen3: the Llama block plus a per-head RMSNorm on q and k before RoPE."""
from __future__ import annotations

import torch

from dabba.arch.config import ArchConfig
from dabba.layers.layernorm import RMSNorm
from dabba.layers.native_form import NativeQKNorm
from dabba.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from dabba.quantization.config import QuantConfig


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ArchConfig, layer_idx: int, prefix: str, quant_config: QuantConfig | None) -> None:
        super().__init__(cfg, layer_idx, prefix, quant_config)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def native_qk_norm(self) -> NativeQKNorm:
        return NativeQKNorm(self.q_norm, self.k_norm)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
