"""The native layer loop (csrc/decode_cpu.cpp): Llama-family steps on the CPU without Python
between ops.

A decode step of SmolLM-135M is about 300 small op calls; in eager PyTorch their Python costs
2 ms of a 10 ms step. The native loop runs the same kernels in the same order as
LlamaDecoderLayer.forward, so its hidden states are bit-identical to the Python path's (tested),
and serves every step on the CPU backend, decodes and prompt chunks alike. 8-bit KV caches
(another layout, the reference backend), other devices, Qwen3's q/k norm and layers without a
native form (act-order GPTQ, dequantized on load) keep the Python path, which stays the reference.
"""
from __future__ import annotations

from typing import Any

import torch

from dabba import native
from dabba.layers.linear import Linear


def build_native_decoder(model: Any) -> Any | None:
    """A torch.classes.dabba_cpu.NativeDecoder over ``model``'s (a LlamaModel's) loaded weights,
    sharing their storage; None where the loop cannot run this model exactly as Python does."""
    from dabba.models.llama import LlamaAttention

    if model.norm.weight.device.type != "cpu" or not native.load_cpu_ops():
        return None
    first = model.layers[0].self_attn
    norms = [n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if any(type(layer.self_attn).norm_qk is not LlamaAttention.norm_qk for layer in model.layers):
        return None  # q/k normalised per head (Qwen3): not in the native loop
    if any(n.eps != model.norm.eps for n in norms):
        return None
    decoder = torch.classes.dabba_cpu.NativeDecoder(first.num_heads, first.num_kv_heads, first.head_dim,
                                                    model.norm.eps, first.attn.scale, model.norm.weight)
    empty = torch.empty(0)
    for layer in model.layers:
        linears: list[Linear] = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                 layer.mlp.down_proj]
        specs = [linear.quant_method.native_spec(linear) for linear in linears]
        if any(spec is None for spec in specs):
            return None
        decoder.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                          [s.kind for s in specs], [s.weight for s in specs],
                          [empty if s.scales is None else s.scales for s in specs], [s.group_size for s in specs],
                          [empty if linear.bias is None else linear.bias for linear in linears])
    return decoder
