"""AWQ (Lin et al., 2023): activation-aware weight quantization.

A few input channels carry large activations; their weights matter most. Scaling those weight
columns up by s before rounding (and the activations down by 1/s) shrinks their relative rounding
error. The 1/s is folded into the op that produces the input (the RMSNorm's weight, or the rows of
the linear before), so the full-precision model is unchanged and nothing is added at run time.

Per group of linears that share an input, s = mean|x|^a / mean|w~|^(1-a) (w~: weights normalised
by their group's max), with a picked from a grid by the error of the module's output on the
calibration activations (identity included, so the search never does worse than plain rounding).
Then each weight's per-group clipping range is shrunk where that lowers its output error. The
final codes are round-to-nearest, asymmetric, per group (rtn.quantize), as AutoAWQ writes them.
"""
from __future__ import annotations

from typing import Callable

import torch

from dabba.quantization.rtn import quantize


def fake_quantize(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Round w [out, in] to its asymmetric per-group codes and back (float32)."""
    return quantize(w, bits, group_size, symmetric=False).dequantize()


def search_scale(x_mean: torch.Tensor, weights: list[torch.Tensor], inspect: Callable[[], torch.Tensor],
                 bits: int, group_size: int, n_grid: int = 20) -> torch.Tensor:
    """Best per-input-channel scale s [in] for the linears whose ``weights`` [out_i, in] (live
    parameters, restored on return) read activations of mean magnitude ``x_mean`` [in];
    ``inspect()`` runs the module whose output error is minimised."""
    reference = inspect()
    originals = [w.clone() for w in weights]
    stacked = torch.cat(originals)
    w_norm = stacked.abs().view(-1, group_size)
    w_mean = (w_norm / (w_norm.amax(-1, keepdim=True) + 1e-6)).view(stacked.shape).mean(0)
    candidates = [torch.ones_like(x_mean)]
    for ratio in (i / n_grid for i in range(n_grid)):
        s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
        candidates.append(s / (s.max() * s.min()).sqrt())
    best, best_err = candidates[0], float("inf")
    for s in candidates:
        for w, w0 in zip(weights, originals):
            w.copy_(fake_quantize(w0 * s, bits, group_size) / s)
        err = (inspect() - reference).float().pow(2).mean().item()
        if err < best_err:
            best, best_err = s, err
    for w, w0 in zip(weights, originals):
        w.copy_(w0)
    return best


def search_clip(w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int, n_grid: int = 20,
                max_shrink: float = 0.5, n_tokens: int = 512, rows_per_batch: int = 256) -> torch.Tensor:
    """Per (output row, group) clipping bound [out, groups] that minimises the group's share of the
    output error on (a sample of) x [tokens, in]."""
    out, k = w.shape
    groups = k // group_size
    x = x[:: max(1, x.shape[0] // n_tokens)].float().view(-1, groups, group_size)  # [n, G, g]
    bounds = []
    for start in range(0, out, rows_per_batch):
        wb = w[start:start + rows_per_batch].float().view(-1, groups, group_size)  # [r, G, g]
        reference = torch.einsum("ngk,rgk->rng", x, wb)
        max_abs = wb.abs().amax(-1)  # [r, G]
        best, best_err = max_abs.clone(), torch.full_like(max_abs, float("inf"))
        for i in range(int(max_shrink * n_grid)):
            bound = max_abs * (1 - i / n_grid)
            clipped = torch.maximum(torch.minimum(wb, bound[..., None]), -bound[..., None])
            q = fake_quantize(clipped.view(len(wb), k), bits, group_size).view_as(wb)
            err = (torch.einsum("ngk,rgk->rng", x, q) - reference).pow(2).mean(1)  # [r, G]
            better = err < best_err
            best_err[better], best[better] = err[better], bound[better]
        bounds.append(best)
    return torch.cat(bounds)


def apply_clip(w: torch.Tensor, bound: torch.Tensor, group_size: int) -> None:
    wg = w.view(w.shape[0], -1, group_size)
    wg.copy_(torch.maximum(torch.minimum(wg, bound[..., None]), -bound[..., None]))


def _v_and_up_rows(layer: torch.nn.Module) -> tuple[slice, slice]:
    """Rows of the merged qkv_proj that are v, and of gate_up_proj that are up."""
    attn, gate_up = layer.self_attn, layer.mlp.gate_up_proj
    return (slice(attn.q_size + attn.kv_size, attn.q_size + 2 * attn.kv_size),
            slice(gate_up.output_sizes[0], gate_up.out_features))


@torch.inference_mode()
def awq_scale_layer(layer: torch.nn.Module, inputs: dict[str, torch.Tensor],
                    rope: tuple[torch.Tensor, torch.Tensor], bits: int, group_size: int, search_tokens: int) -> None:
    """Search AWQ scales for a Llama-family decoder layer and fold them in, in place: the layer's
    full-precision function is unchanged, its weights are easier to round.

    ``inputs``: the calibration activations entering each linear ("self_attn.qkv_proj", ...),
    captured from the full-precision layer; they are divided by the scales as those are applied.
    The search runs the modules on the first ``search_tokens`` rows (whole sequences); the channel
    statistics use all rows. The layer's attention must be runnable (the caller sets a
    forward_context).
    """
    attn, mlp = layer.self_attn, layer.mlp
    qkv, o, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
    v_rows, up_rows = _v_and_up_rows(layer)
    n = search_tokens
    rope = (rope[0][:n], rope[1][:n])

    def search_and_fold(name: str, linear: torch.nn.Module, module: Callable[[torch.Tensor], torch.Tensor],
                        prev_weight: torch.Tensor, prev_bias: torch.Tensor | None) -> None:
        """x' = x / s comes from the previous op (its weight, or its rows, / s); w' = w * s."""
        x = inputs[name]
        s = search_scale(x.abs().mean(0), [linear.weight.data], lambda: module(x[:n]), bits, group_size)
        prev_weight.div_(s.view(-1, *([1] * (prev_weight.dim() - 1))))
        if prev_bias is not None:
            prev_bias.div_(s)
        linear.weight.data.mul_(s)
        inputs[name] = x / s

    search_and_fold("self_attn.qkv_proj", qkv, lambda x: attn(rope, x), layer.input_layernorm.weight.data, None)
    if attn.num_heads == attn.num_kv_heads:  # with GQA one v channel feeds several o channels: no free scale
        search_and_fold("self_attn.o_proj", o, o, qkv.weight.data[v_rows],
                        None if qkv.bias is None else qkv.bias.data[v_rows])
    search_and_fold("mlp.gate_up_proj", gate_up, mlp, layer.post_attention_layernorm.weight.data, None)
    search_and_fold("mlp.down_proj", down, down, gate_up.weight.data[up_rows],
                    None if gate_up.bias is None else gate_up.bias.data[up_rows])


@torch.inference_mode()
def awq_clip_layer(layer: torch.nn.Module, inputs: dict[str, torch.Tensor], bits: int, group_size: int) -> None:
    """Clip each linear's weights to the searched per-group range, in place; not q and k, whose
    errors the softmax amplifies (as AutoAWQ)."""
    v_rows, _ = _v_and_up_rows(layer)
    attn, mlp = layer.self_attn, layer.mlp
    for name, linear, rows in (("self_attn.qkv_proj", attn.qkv_proj, v_rows), ("self_attn.o_proj", attn.o_proj, slice(None)),
                               ("mlp.gate_up_proj", mlp.gate_up_proj, slice(None)),
                               ("mlp.down_proj", mlp.down_proj, slice(None))):
        w = linear.weight.data[rows]
        apply_clip(w, search_clip(w, inputs[name], bits, group_size), group_size)
