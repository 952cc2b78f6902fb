"""Gemma 2 and Gemma 3 (text): the Llama block's merged q/k/v and gate/up linears, attention and
weight loading, with Gemma's differences, read from ArchConfig:

- GeGLU MLP (mlp_activation "gelu_tanh": gelu_pytorch_tanh(gate) * up);
- (1 + w) RMSNorms in float32 (GemmaRMSNorm), four per layer: input -> attention ->
  post_attention -> + residual -> pre_feedforward -> MLP -> post_feedforward -> + residual;
- embeddings times sqrt(hidden_size), rounded to the model dtype first (VocabEmbedding);
- attention scale query_pre_attn_scalar ** -0.5; soft caps (Gemma 2) on the attention scores
  (the backends) and on the final logits (compute_logits);
- sliding-window layers where layer_types says (Gemma 2: every other one from layer 0; Gemma 3:
  five of every six);
- Gemma 3: per-head q/k GemmaRMSNorm before RoPE, and its sliding layers' own RoPE base
  (rope_local_theta) while the global layers take rope_theta and the rope scaling.

Gemma 2 and Gemma 3 differ only in those config fields, so one class serves both. The layers keep
LlamaDecoderLayer's contract, (x, residual) -> (x, residual) with the residual add fused into the
next norm, so calibration (dabba quantize) drives them the same way. The native layer loop
(csrc/decode_cpu.cpp) runs them too: the gemma_* norm kernels, the norms around the MLP, GeGLU,
the soft cap and a RoPE table per attention kind.
"""
from __future__ import annotations

import torch
from torch import nn

from dabba.arch.config import ArchConfig
from dabba.layers.embedding import VocabEmbedding
from dabba.layers.layernorm import GemmaRMSNorm
from dabba.layers.native_form import NativeLayer, NativeQKNorm
from dabba.layers.rotary import LayerTypeRotary
from dabba.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from dabba.quantization.config import QuantConfig

RopeTables = dict[str, tuple[torch.Tensor, torch.Tensor]]  # LayerTypeRotary.cos_sin: per attention kind


class GemmaAttention(LlamaAttention):
    """LlamaAttention (scale, soft cap and window from ArchConfig) plus Gemma 3's q/k norms."""

    def __init__(self, cfg: ArchConfig, layer_idx: int, prefix: str, quant_config: QuantConfig | None) -> None:
        super().__init__(cfg, layer_idx, prefix, quant_config)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def native_qk_norm(self) -> NativeQKNorm | None:
        return None if self.q_norm is None else NativeQKNorm(self.q_norm, self.k_norm)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int, prefix: str, quant_config: QuantConfig | None) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(cfg, layer_idx, f"{prefix}.self_attn", quant_config)
        self.mlp = LlamaMLP(cfg, f"{prefix}.mlp", quant_config)
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        # RoPE follows the layer's kind even where sliding_window is null (as transformers' does)
        sliding = cfg.sliding_layers is not None and cfg.sliding_layers[layer_idx]
        self.rope_kind = "sliding_attention" if sliding else "full_attention"

    def native_form(self) -> NativeLayer:
        """forward() below, as the native loop runs it: Gemma's order (a pre_mlp_norm)."""
        attn = self.self_attn
        return NativeLayer(self.input_layernorm, self.post_attention_layernorm, attn.qkv_proj, attn.o_proj, attn.attn,
                           self.mlp.native_mlp(), attn.native_qk_norm(), self.pre_feedforward_layernorm,
                           self.post_feedforward_layernorm, self.rope_kind)

    def forward(self, rope: RopeTables, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's normed MLP output, the residual stream before it); the next norm
        adds them, as in LlamaDecoderLayer."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(rope[self.rope_kind], x))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(LlamaModel):
    """LlamaModel's embed and forward over Gemma's layers: scaled embeddings, RoPE tables per
    attention kind (each layer takes its kind's), a (1 + w) final norm."""

    norm_cls = GemmaRMSNorm

    def make_embedding(self, cfg: ArchConfig) -> VocabEmbedding:
        return VocabEmbedding(cfg.vocab_size, cfg.hidden_size, scale=cfg.hidden_size ** 0.5)

    def make_rotary(self, cfg: ArchConfig, max_position: int) -> nn.Module:
        return LayerTypeRotary(cfg.rotary_dim or cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling,
                               cfg.rope_local_theta)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (tied or untied LM head, as the config says)."""

    model_cls = GemmaModel
    layer_cls = GemmaDecoderLayer

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # [num_rows, vocab]
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap  # in the model dtype, as transformers
