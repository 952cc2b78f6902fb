"""compressed-tensors W8A8 checkpoints written (`dabba quantize --method w8a8 | smoothquant`): each
linear's tensors from its float weight, static activation scales from the calibration inputs'
range, and config.json's quantization_config; the format itself (what is read, and refused) is
compressed_tensors.py's."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dabba.quantization.compressed_tensors import QUANT_METHOD, W8A8Scheme
from dabba.quantization.rtn import quantize_rows


@dataclass
class ActivationRange:
    """The least and greatest input one linear saw over calibration, as llm-compressor's
    "static_minmax" observer keeps them (its default "minmax" instead moves 1% toward each new
    batch's range: a weighted memory of the first batches, not the range)."""

    lo: torch.Tensor = field(default_factory=lambda: torch.tensor(math.inf))
    hi: torch.Tensor = field(default_factory=lambda: torch.tensor(-math.inf))

    def observe(self, x: torch.Tensor) -> None:
        if x.numel() == 0:
            return
        lo, hi = torch.aminmax(x.detach().float())
        self.lo, self.hi = torch.minimum(self.lo, lo), torch.maximum(self.hi, hi)

    def qparams(self, asymmetric: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(input_scale [1] float32, input_zero_point [1] int8 or None): compressed-tensors'
        calculate_qparams over [min(lo, 0), max(hi, 0)], in float32: symmetric s = max|x| / 127.5,
        asymmetric s = (hi - lo) / 255, zp = round(clamp(-128 - lo / s, -128, 127)); s 0 -> float32 eps."""
        if not math.isfinite(float(self.lo)):
            raise ValueError("no calibration input reached this layer: its static activation scale is unknown")
        lo, hi = torch.clamp(self.lo, max=0.0), torch.clamp(self.hi, min=0.0)
        eps = torch.tensor(torch.finfo(torch.float32).eps)
        if not asymmetric:
            scale = torch.maximum(lo.abs(), hi.abs()) / (torch.tensor(255.0) / 2)
            return torch.where(scale == 0, eps, scale).reshape(1), None
        scale = (hi - lo) / torch.tensor(255.0)
        if scale == 0:
            return eps.reshape(1), torch.zeros(1, dtype=torch.int8)
        zero = torch.round(torch.clamp(-128 - lo / scale, -128, 127)).to(torch.int8)
        return scale.reshape(1), zero.reshape(1)


def compress_linear(name: str, weight: torch.Tensor, scheme: W8A8Scheme,
                    inputs: ActivationRange | None = None) -> dict[str, torch.Tensor]:
    """One checkpoint linear ``name`` (unmerged: "model.layers.0.self_attn.q_proj") from its float
    weight [out, in] as the format stores it: int8 codes of dabba's INT8 rounding (rtn.quantize:
    s = 2 max|w| / 255, what compressed-tensors' minmax gives, and load-time ``w8a8``'s codes), a
    float32 weight_scale, and for a static scheme the activation scale from ``inputs`` (the bias
    is not here: the caller copies it). The entry for any method that prepares float weights
    (SmoothQuant's smoothed ones)."""
    w = weight.float()
    if scheme.weight_strategy == "tensor":
        r_max = w.abs().amax().expand(w.shape[0], 1)
        qw = quantize_rows(w, 8, w.shape[1], symmetric=True, codes_dtype=torch.int8, r_max=r_max)
        scale = qw.scale[:1, :1].reshape(1)
    else:
        qw = quantize_rows(w, 8, w.shape[1], symmetric=True, codes_dtype=torch.int8)
        scale = qw.scale  # [out, 1]
    tensors = {f"{name}.weight": qw.q, f"{name}.weight_scale": scale.float().contiguous()}
    if scheme.static:
        if inputs is None:
            raise ValueError(f"{name}: a static scheme needs the layer's calibration input range")
        input_scale, input_zero = inputs.qparams(scheme.asymmetric)
        tensors[f"{name}.input_scale"] = input_scale
        if input_zero is not None:
            tensors[f"{name}.input_zero_point"] = input_zero
    return tensors


def dequantized_weight(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """What compress_linear's ``name`` tensors dequantize to: codes x weight_scale, float32 [out, in]."""
    return tensors[f"{name}.weight"].float() * tensors[f"{name}.weight_scale"].reshape(-1, 1)


def quantization_config(scheme: W8A8Scheme, ignore: list[str]) -> dict[str, Any]:
    """config.json's quantization_config for a checkpoint whose linears are all ``scheme``'s but
    those ``ignore`` names (the LM head, routers), as compressed-tensors writes it."""
    return {"quant_method": QUANT_METHOD, "format": "int-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": scheme.config_group(["Linear"])}, "ignore": list(ignore),
            "kv_cache_scheme": None, "global_compression_ratio": None, "sparsity_config": {}, "transform_config": {}}
