"""SmoothQuant (Xiao et al., 2023): make activations easy to round to 8 bits by moving their outliers
into the weights.

W8A8 rounds each token's activations with one scale for the whole row. LLMs carry a few input
channels whose activations run 10-100x larger than the rest, in every token; the row's scale is then
set by them, and the other channels keep only a few of the 255 steps. Per input channel j, with
s_j = max|x_j|^alpha / max|w_j|^(1 - alpha) over the calibration tokens and the weights of every linear
that reads x, x' = x / s and w' = w * s: the product is unchanged, the activations' range is evened
out and part of it moved to the weights, which are rounded per output channel and take it better.
alpha (the migration strength) trades the two: 0.5 by default, as llm-compressor; 0.75-0.85 for
models with heavy outliers.

The 1/s is folded into the RMSNorm that produces x (its weight; Gemma's norm multiplies by 1 + w, so
1 + w is divided), so nothing is added at run time and the full-precision model is unchanged. As
llm-compressor's default mappings: the attention's input norm -> q, k, v, and the MLP's input norm
(post_attention_layernorm; Gemma's pre_feedforward_layernorm) -> gate, up, as each family's layer
declares them (native_form). The inputs of o_proj and down_proj come from no norm and are left as
they are; so is a mixture of experts' input (its router and every expert read it).
"""
from __future__ import annotations

import torch
from torch import nn

from dabba.layers.layernorm import GemmaRMSNorm


def smoothing_scales(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [in] for activations whose per-channel max |x| is ``act_absmax`` [in], read by ``weight``
    [out, in] (every linear that reads them, stacked). A channel that is zero on either side keeps 1."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha (the migration strength) must be in [0, 1], got {alpha}")
    a = act_absmax.double()
    w = weight.double().abs().amax(dim=0)
    s = a.pow(alpha) / w.pow(1.0 - alpha)
    keep = (a > 0) & (w > 0) & torch.isfinite(s) & (s > 0)
    return torch.where(keep, s, torch.ones_like(s)).float()


def smoothed_pairs(layer: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(norm, the merged linear that reads its output) of a decoder layer: qkv, and a dense MLP's gate_up."""
    form = layer.native_form()
    pairs = [(form.input_norm, form.qkv)]
    if form.mlp.gate_up is not None:
        pairs.append((form.pre_mlp_norm or form.post_attention_norm, form.mlp.gate_up))
    return pairs


@torch.inference_mode()
def smooth_layer(layer: nn.Module, act_absmax: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """Fold SmoothQuant's scales into a decoder layer, in place. ``act_absmax``: by the layer's
    module names, the max |x| per input channel each linear saw over the calibration tokens.
    Returns the scales, by the smoothed linears' names."""
    names = {module: name for name, module in layer.named_modules()}
    applied = {}
    for norm, linear in smoothed_pairs(layer):
        s = smoothing_scales(act_absmax[names[linear]], linear.weight.data, alpha)
        if isinstance(norm, GemmaRMSNorm):  # (1 + w) / s - 1
            norm.weight.data.copy_(((1.0 + norm.weight.data.double()) / s.double() - 1.0).to(norm.weight.dtype))
        else:
            norm.weight.data.div_(s.to(norm.weight.dtype))
        linear.weight.data.mul_(s.to(linear.weight.dtype))
        applied[names[linear]] = s
    return applied
