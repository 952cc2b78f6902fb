"""The native layer loop (csrc/decode_cpu.cpp): a Llama-family or Gemma model's layers on the CPU
without Python between ops.

A small model's decode step is hundreds of small op calls, whose Python costs a fifth of the step
in eager PyTorch (benchmarks/layer_loop.py). The native loop runs the same kernels in the same order as
LlamaDecoderLayer.forward, so its hidden states are bit-identical to the Python path's (tested).
It is a second implementation of the layers: a change to a decoder layer's forward, a forward
hook or a new family has no effect on it, unless the family's declared native form
(layers/native_form.py: each decoder layer's native_form() beside its forward) says so. It
assembles those forms and probes nothing. It never attaches itself: the model runner
chooses between it and the Python layers, which stay the reference, in one place
(worker/layer_loop.select_layer_loop), and the model runner logs which one runs and why.
"""
from __future__ import annotations

from typing import Any

import torch

from dabba.attention.cpu import CpuMetadata
from dabba.attention.kv_quant import KVQuant
from dabba.distributed.tensor_parallel import SINGLE, TensorParallel
from dabba.layers.embedding import EmbeddingRows
from dabba.layers.native_form import ROPE_TABLES, NoNativeForm
from dabba.ops import native


def missing_native_form(model: Any) -> str | None:
    """Why the loop cannot compute this loaded ``model`` exactly as its Python layers do (from the
    forms its family declares); None when it can."""
    if not native.load_cpu_ops():
        return "the native CPU kernels are unavailable"
    try:
        forms = model.native_layers()
    except NoNativeForm as e:
        return str(e)
    inner = model.model
    if inner.norm.weight.device.type != "cpu":
        return f"the weights are on {inner.norm.weight.device.type}, the loop runs on the CPU"
    norms = [n for form in forms for n in form.norms]
    if any(n.eps != inner.norm.eps for n in norms):
        return "its RMSNorms do not share one eps"
    if any(type(n) is not type(inner.norm) for n in norms):
        return "its RMSNorms are not all of one kind"
    if len({form.attention.softcap for form in forms}) > 1:
        return "its layers' attention soft caps differ"
    for form in forms:
        for linear in form.linears + form.expert_linears:
            if linear.quant_method.native_spec(linear) is None:
                return f"{linear.prefix} ({type(linear.quant_method).__name__}) has no native form"
    return None


class NativeLayerLoop:
    """torch.classes.dabba_cpu.NativeDecoder over a loaded model's weights (sharing their storage),
    called with the CPU backend's metadata and caches: full precision, or 8-bit with ``kv_quant``
    (per layer a pair (codes, scales), as CpuBackend's). Build it only where
    ``missing_native_form`` is None."""

    def __init__(self, model: Any, kv_quant: KVQuant | None = None, tp: TensorParallel = SINGLE) -> None:
        self.model = model.model  # the LlamaModel: its embedding and rotary tables stay in Python
        self.kv_quant = kv_quant
        forms = model.native_layers()  # each family declares its layers' (layers/native_form.py)
        first = forms[0].attention  # heads, scale and soft cap: the same in every layer
        kinds = native.kernel_constants().linear_kinds
        self.decoder = torch.classes.dabba_cpu.NativeDecoder(
            first.num_heads, first.num_kv_heads, first.head_dim, self.model.norm.eps, first.scale,
            self.model.norm.weight, 0.0 if kv_quant is None else kv_quant.q_max, self.model.norm.native_norm,
            model.config.mlp_activation, first.softcap or 0.0)
        if tp.size > 1:  # a rank's shards: the loop sums them over the group's shared memory
            self.decoder.set_group(*tp.communicator.native_group_args())
        empty = torch.empty(0)
        for form in forms:
            linears = form.linears
            kind_ids, weights, scales, group_sizes, sums = _specs(linears, kinds)
            qk = form.qk_norm
            q_norm, k_norm = (qk.q_norm.weight, qk.k_norm.weight) if qk is not None else (empty, empty)
            pre_mlp = empty if form.pre_mlp_norm is None else form.pre_mlp_norm.weight
            post_mlp = empty if form.post_mlp_norm is None else form.post_mlp_norm.weight
            self.decoder.add_layer(form.input_norm.weight, form.post_attention_norm.weight, pre_mlp, post_mlp,
                                   q_norm, k_norm, qk is not None and qk.whole,
                                   kind_ids, weights, scales, group_sizes, sums,
                                   [empty if linear.bias is None else linear.bias for linear in linears],
                                   form.attention.sliding_window or 0, ROPE_TABLES.index(form.rope_table))
            moe = form.mlp.moe
            if moe is not None:
                self.decoder.add_moe(moe.gate.weight, *_specs(form.expert_linears, kinds), moe.cfg.top_k,
                                     moe.cfg.renormalize, moe.cfg.weights_in_model_dtype)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: list[CpuMetadata],
                 kv_caches: list[Any], layer_groups: list[int] | None = None,
                 image_embeds: EmbeddingRows | None = None) -> torch.Tensor:
        """The final norm's output [num_tokens, hidden], as LlamaModel.forward returns it.
        ``metadata``: one per KV-cache group; ``layer_groups``: each layer's (None: one group)."""
        x, rope = self.model.embed(input_ids, positions, image_embeds)
        tables = [rope[kind] for kind in ROPE_TABLES] if isinstance(rope, dict) else [rope]  # Gemma's per kind
        first = metadata[0]
        caches, scales = self._cache_operands(kv_caches)
        return self.decoder.forward(x, [cos for cos, _ in tables], [sin for _, sin in tables], caches, scales,
                                    [m.block_table for m in metadata], [m.slot_mapping for m in metadata],
                                    layer_groups or [], first.seq_lens,
                                    None if first.decode_only else first.query_start_loc,
                                    None if first.decode_only else first.key_ends)

    def _cache_operands(self, kv_caches: list[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer the cache tensor, and per layer the scales (none for full precision): 8-bit
        codes viewed in their own dtype, which tells the kernels int8 from fp8."""
        if self.kv_quant is None:
            return kv_caches, []
        code_dtype = self.kv_quant.code_dtype
        return [codes.view(code_dtype) for codes, _ in kv_caches], [scales for _, scales in kv_caches]


def _specs(linears: list[Any], kinds: dict[str, int]) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor],
                                                           list[int], list[torch.Tensor]]:
    """The linears' native forms as NativeDecoder takes them: kinds, weights, scales (empty where
    none), group sizes and codes' sums (empty where none)."""
    specs = [linear.quant_method.native_spec(linear) for linear in linears]
    empty = torch.empty(0)
    return ([kinds[s.kind] for s in specs], [s.weight for s in specs],
            [empty if s.scales is None else s.scales for s in specs], [s.group_size for s in specs],
            [empty if s.sums is None else s.sums for s in specs])
