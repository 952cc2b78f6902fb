"""GPTQ (Frantar et al., 2022): quantize a layer's weight column by column, pushing each column's
rounding error onto the columns not yet quantized, weighted by the inverse Hessian of the layer's
reconstruction loss ||W X - Q X||^2 (H = 2 X X^T over calibration activations).

Scales and zero points follow round-to-nearest's formula (rtn.quantize) per group of input
channels, computed when the quantizer reaches a group's first column. With ``act_order`` the
columns are visited in order of decreasing Hessian diagonal; ``g_idx`` then maps each input
channel to its group (the GPTQ checkpoint field of that name).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dabba.quantization.rtn import quantize


@dataclass
class GPTQWeight:
    q: torch.Tensor  # [out, in] int32 codes, original column order
    scale: torch.Tensor  # [out, num_groups]
    zero: torch.Tensor  # [out, num_groups] int32
    g_idx: torch.Tensor  # [in] int32: group of each input channel

    def dequantize(self) -> torch.Tensor:
        scale = self.scale[:, self.g_idx]  # [out, in]
        zero = self.zero[:, self.g_idx]
        return (self.q - zero).float() * scale


class HessianAccumulator:
    """H = 2/n * sum over calibration tokens of x x^T, fed batch by batch."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu") -> None:
        self.H = torch.zeros(in_features, in_features, dtype=torch.float64, device=device)
        self.num_samples = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).double()  # [tokens, in]
        n = x.shape[0]
        self.H *= self.num_samples / (self.num_samples + n)
        self.num_samples += n
        self.H += (2.0 / self.num_samples) * x.T @ x


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int = 4, group_size: int = 128,
                  symmetric: bool = False, damp: float = 0.01, act_order: bool = False,
                  block_size: int = 128) -> GPTQWeight:
    W = weight.detach().double().clone()  # [out, in]
    out_features, in_features = W.shape
    if in_features % group_size:
        raise ValueError(f"in_features ({in_features}) must be a multiple of group_size ({group_size})")
    H = hessian.detach().double().clone()
    dead = torch.diag(H) == 0  # channels never active in calibration: weight irrelevant, keep H invertible
    H[dead, dead] = 1
    W[:, dead] = 0

    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(in_features)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(in_features, dtype=H.dtype)
    # Upper Cholesky factor of H^-1: row i holds what quantizing column i does to columns > i.
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    num_groups = in_features // group_size
    codes = torch.zeros(out_features, in_features, dtype=torch.int32)
    scales = torch.zeros(out_features, num_groups, dtype=torch.float64)
    zeros = torch.zeros(out_features, num_groups, dtype=torch.int32)
    for i1 in range(0, in_features, block_size):
        i2 = min(i1 + block_size, in_features)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = col // group_size
            if col % group_size == 0:  # a new group: its parameters from the columns as they are now
                group = torch.cat([W1[:, i:], W[:, i2:]], dim=1)[:, :group_size]
                params = quantize(group.float(), bits, group_size, symmetric)
                scales[:, g], zeros[:, g] = params.scale[:, 0].double(), params.zero[:, 0]
            s, z = scales[:, g], zeros[:, g]
            w = W1[:, i]
            if symmetric:
                q = torch.clamp(torch.round(w / s), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
                dq = q * s
            else:
                q = torch.clamp(torch.round(w / s) + z, 0, 2**bits - 1)
                dq = (q - z) * s
            codes[:, col] = q.to(torch.int32)
            err = (w - dq) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    inv = torch.argsort(perm)
    g_idx = (inv // group_size).to(torch.int32)  # column j was visited at position inv[j]
    return GPTQWeight(codes[:, inv], scales.float(), zeros, g_idx)
