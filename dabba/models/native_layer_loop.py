"""The native layer loop (csrc/decode_cpu.cpp): a Llama-family or Gemma model's layers on the CPU
without Python between ops.

A decode step of SmolLM-135M is about 300 small op calls; in eager PyTorch their Python costs
2 ms of a 10 ms step. The native loop runs the same kernels in the same order as
LlamaDecoderLayer.forward, so its hidden states are bit-identical to the Python path's (tested).
It is a second implementation of the layers: a change to a decoder layer's forward, a forward
hook or a new family has no effect on it. So it never attaches itself: the model runner
chooses between it and the Python layers, which stay the reference, in one place
(worker/layer_loop.select_layer_loop), and the model runner logs which one runs and why.
"""
from __future__ import annotations

from typing import Any

import torch

from dabba.ops import native
from dabba.attention.cpu import CpuMetadata
from dabba.attention.kv_quant import KVQuant
from dabba.distributed.tensor_parallel import SINGLE, TensorParallel
from dabba.layers.fused_moe import FusedMoE


def missing_native_form(model: Any) -> str | None:
    """Why the loop cannot compute this loaded Llama-family ``model`` (``LlamaForCausalLM`` or a
    subclass: Qwen3, Gemma, the mixtures of experts) exactly as its Python layers do; None when
    it can."""
    if not native.load_cpu_ops():
        return "the native CPU kernels are unavailable"
    inner = model.model
    if inner.norm.weight.device.type != "cpu":
        return f"the weights are on {inner.norm.weight.device.type}, the loop runs on the CPU"
    norms = [n for layer in inner.layers for n in (layer.input_layernorm, layer.post_attention_layernorm,
                                                   *_ffw_norms(layer), *_qk_norms(layer))]
    if any(n.eps != inner.norm.eps for n in norms):
        return "its RMSNorms do not share one eps"
    if any(type(n) is not type(inner.norm) for n in norms):
        return "its RMSNorms are not all of one kind"
    if len({layer.self_attn.attn.softcap for layer in inner.layers}) > 1:
        return "its layers' attention soft caps differ"
    for layer in inner.layers:
        for linear in _linears(layer) + _expert_linears(layer):
            if linear.quant_method.native_spec(linear) is None:
                return f"{linear.prefix} ({type(linear.quant_method).__name__}) has no native form"
    return None


def _moe(layer: Any) -> FusedMoE | None:
    return layer.mlp if isinstance(layer.mlp, FusedMoE) else None


def _qk_norms(layer: Any) -> list[Any]:
    attn = layer.self_attn
    return [attn.q_norm, attn.k_norm] if getattr(attn, "q_norm", None) is not None else []


def _ffw_norms(layer: Any) -> list[Any]:
    """Gemma's norms before and after the MLP (the attention output's is post_attention_layernorm)."""
    return [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm] if hasattr(
        layer, "pre_feedforward_layernorm") else []


ROPE_TABLES = ("full_attention", "sliding_attention")  # LayerTypeRotary.cos_sin's keys, in add_layer's order


def _linears(layer: Any) -> list[Any]:
    """A decoder layer's linears in the order NativeDecoder.add_layer takes them: qkv, o, then a
    dense MLP's gate_up and down (a mixture of experts' go to add_moe)."""
    attn = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
    return attn if _moe(layer) is not None else attn + [layer.mlp.gate_up_proj, layer.mlp.down_proj]


def _expert_linears(layer: Any) -> list[Any]:
    """Each expert's gate_up and down in turn, as NativeDecoder.add_moe takes them (none: dense)."""
    moe = _moe(layer)
    return [] if moe is None else [linear for e in moe.experts for linear in (e.gate_up_proj, e.down_proj)]


class NativeLayerLoop:
    """torch.classes.dabba_cpu.NativeDecoder over a loaded model's weights (sharing their storage),
    called with the CPU backend's metadata and caches: full precision, or 8-bit with ``kv_quant``
    (per layer a pair (codes, scales), as CpuBackend's). Build it only where
    ``missing_native_form`` is None."""

    def __init__(self, model: Any, kv_quant: KVQuant | None = None, tp: TensorParallel = SINGLE) -> None:
        self.model = model.model  # the LlamaModel: its embedding and rotary tables stay in Python
        self.kv_quant = kv_quant
        cfg = model.config
        first = self.model.layers[0].self_attn
        kinds = native.kernel_constants().linear_kinds
        self.decoder = torch.classes.dabba_cpu.NativeDecoder(
            first.num_heads, first.num_kv_heads, first.head_dim, self.model.norm.eps, first.attn.scale,
            self.model.norm.weight, 0.0 if kv_quant is None else kv_quant.q_max, self.model.norm.native_norm,
            cfg.mlp_activation, first.attn.softcap or 0.0)
        if tp.size > 1:  # a rank's shards: the loop sums them over the group's shared memory
            self.decoder.set_group(*tp.communicator.native_group_args())
        empty = torch.empty(0)
        for layer in self.model.layers:
            linears = _linears(layer)
            kind_ids, weights, scales, group_sizes = _specs(linears, kinds)
            qk_norms, ffw_norms = _qk_norms(layer), _ffw_norms(layer)
            q_norm, k_norm = (n.weight for n in qk_norms) if qk_norms else (empty, empty)
            pre_ffw, post_ffw = (n.weight for n in ffw_norms) if ffw_norms else (empty, empty)
            self.decoder.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                   pre_ffw, post_ffw, q_norm, k_norm, cfg.qk_norm_whole,
                                   kind_ids, weights, scales, group_sizes,
                                   [empty if linear.bias is None else linear.bias for linear in linears],
                                   layer.self_attn.attn.sliding_window or 0,
                                   ROPE_TABLES.index(getattr(layer, "rope_kind", ROPE_TABLES[0])))
            moe = _moe(layer)
            if moe is not None:
                self.decoder.add_moe(moe.gate.weight, *_specs(_expert_linears(layer), kinds), moe.cfg.top_k,
                                     moe.cfg.renormalize, moe.cfg.weights_in_model_dtype)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: list[CpuMetadata],
                 kv_caches: list[Any], layer_groups: list[int] | None = None) -> torch.Tensor:
        """The final norm's output [num_tokens, hidden], as LlamaModel.forward returns it.
        ``metadata``: one per KV-cache group; ``layer_groups``: each layer's (None: one group)."""
        x, rope = self.model.embed(input_ids, positions)
        tables = [rope[kind] for kind in ROPE_TABLES] if isinstance(rope, dict) else [rope]  # Gemma's per kind
        first = metadata[0]
        caches, scales = self._cache_operands(kv_caches)
        return self.decoder.forward(x, [cos for cos, _ in tables], [sin for _, sin in tables], caches, scales,
                                    [m.block_table for m in metadata], [m.slot_mapping for m in metadata],
                                    layer_groups or [], first.seq_lens,
                                    None if first.decode_only else first.query_start_loc)

    def _cache_operands(self, kv_caches: list[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer the cache tensor, and per layer the scales (none for full precision): 8-bit
        codes viewed in their own dtype, which tells the kernels int8 from fp8."""
        if self.kv_quant is None:
            return kv_caches, []
        code_dtype = self.kv_quant.code_dtype
        return [codes.view(code_dtype) for codes, _ in kv_caches], [scales for _, scales in kv_caches]


def _specs(linears: list[Any],
           kinds: dict[str, int]) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor], list[int]]:
    """The linears' native forms as NativeDecoder takes them: kinds, weights, scales (empty where
    none) and group sizes."""
    specs = [linear.quant_method.native_spec(linear) for linear in linears]
    empty = torch.empty(0)
    return ([kinds[s.kind] for s in specs], [s.weight for s in specs],
            [empty if s.scales is None else s.scales for s in specs], [s.group_size for s in specs])
