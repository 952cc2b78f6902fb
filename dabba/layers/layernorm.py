"""RMSNorm as transformers computes it (float32 statistics, rounded to the model dtype, then
scaled), optionally fused with the residual add that precedes it in every decoder layer; and
Gemma's, which scales by (1 + w) in float32 before rounding."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dabba.ops import native


class RMSNorm(nn.Module):
    # the native kernels of this form: norm(x) into out, and the fused residual add + norm in place
    native_norm = "rms_norm"
    native_fused = "fused_add_rms_norm"

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x) over the last dim; or, with ``residual``: residual <- x + residual, returns
        (norm(residual), residual).

        The fused form may reuse ``x`` and ``residual``'s storage: callers pass tensors they own.
        On the CPU the native kernels compute the same (their float32 sum of squares is ordered
        differently: a bf16 output may differ in the last bit); per-head q/k norms go through them
        as rows of head_dim.
        """
        if native.use_cpu_kernels(x) and x.dtype == self.weight.dtype:
            d = x.shape[-1]
            if residual is None:
                rows = x.reshape(-1, d).contiguous()  # q or k of the merged projection: copied
                out = torch.empty_like(rows)
                getattr(torch.ops.dabba_cpu, self.native_norm)(out, rows, self.weight, self.eps)
                return out.view(x.shape)
            if x.is_contiguous() and residual.is_contiguous():
                getattr(torch.ops.dabba_cpu, self.native_fused)(x.view(-1, d), residual.view(-1, d), self.weight,
                                                                self.eps)
                return x, residual
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, round to the model dtype, then scale: the reference's rounding order.
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), all in float32, rounded to the model
    dtype once at the end (Llama's rounds before scaling). The checkpoint stores w; zero is the
    identity. The same residual fusion and native path as RMSNorm; in plain PyTorch, op for op as
    transformers' Gemma2RMSNorm / Gemma3RMSNorm, so results are bit-identical to it."""

    native_norm = "gemma_rms_norm"
    native_fused = "gemma_fused_add_rms_norm"

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)
