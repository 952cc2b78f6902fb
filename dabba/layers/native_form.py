"""What a decoder layer is to the native layer loop (csrc/decode_cpu.cpp's NativeDecoder): each
family declares its layers' forms (``native_layers()`` on the model, ``native_form()`` on each
decoder layer, ``native_mlp()`` / ``native_qk_norm()`` on its parts, each beside its ``forward``),
or says why it has none (NoNativeForm); models/native_layer_loop.py only assembles the forms."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROPE_TABLES = ("full_attention", "sliding_attention")  # LayerTypeRotary.cos_sin's keys, in add_layer's order


@dataclass(frozen=True)
class NativeQKNorm:
    """RMSNorms of q and k before RoPE: per head (Qwen3, Gemma 3), or over the whole projection (OLMoE)."""

    q_norm: Any  # an RMSNorm of layers/layernorm.py
    k_norm: Any
    whole: bool = False


@dataclass(frozen=True)
class NativeMLP:
    """A dense gated MLP's two linears, or a mixture of experts (a FusedMoE, layers/fused_moe.py)."""

    gate_up: Any | None = None
    down: Any | None = None
    moe: Any | None = None


@dataclass(frozen=True)
class NativeLayer:
    """One decoder layer as NativeDecoder.add_layer (and add_moe) takes it::

        Llama:  x, residual = input_norm(x, residual); x = o(attend(rope(qk_norm(qkv(x)))))
                x, residual = post_attention_norm(x, residual); x = mlp(x)
        Gemma:  ... x = post_attention_norm(o(...)); x, residual = pre_mlp_norm(x, residual)
                x = post_mlp_norm(mlp(x))

    (a layer with a pre_mlp_norm runs Gemma's order)."""

    input_norm: Any  # RMSNorms of layers/layernorm.py
    post_attention_norm: Any
    qkv: Any  # Linear layers (layers/linear.py), each with its quant_method's native_spec
    o: Any
    attention: Any  # the Attention (layers/attention.py): heads, head_dim, scale, sliding window, soft cap
    mlp: NativeMLP
    qk_norm: NativeQKNorm | None = None
    pre_mlp_norm: Any | None = None  # Gemma's pre- and post-feed-forward norms
    post_mlp_norm: Any | None = None
    rope_table: str = ROPE_TABLES[0]  # which RoPE table the layer takes

    @property
    def norms(self) -> list[Any]:
        qk = [self.qk_norm.q_norm, self.qk_norm.k_norm] if self.qk_norm is not None else []
        mlp = [n for n in (self.pre_mlp_norm, self.post_mlp_norm) if n is not None]
        return [self.input_norm, self.post_attention_norm, *mlp, *qk]

    @property
    def linears(self) -> list[Any]:
        """In the order NativeDecoder.add_layer takes them: qkv, o, then a dense MLP's gate_up and down."""
        return [self.qkv, self.o] + ([] if self.mlp.moe is not None else [self.mlp.gate_up, self.mlp.down])

    @property
    def expert_linears(self) -> list[Any]:
        """Each expert's gate_up and down in turn, as NativeDecoder.add_moe takes them (none: dense)."""
        moe = self.mlp.moe
        return [] if moe is None else [linear for e in moe.experts for linear in (e.gate_up_proj, e.down_proj)]


class NoNativeForm(Exception):
    """Raised by a module's ``native_form()`` where the native loop cannot run it; the message
    says why, and the model runner's start-up log names it."""
