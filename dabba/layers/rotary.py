"""Rotary position embedding (half-rotation layout, as Llama/Qwen/Phi checkpoints use), with
"linear", "llama3", "longrope", "yarn" and per-frequency ("freq_factors", from GGUF files) scaling,
over the whole head or its first rotary_dim dims (partial rotary: the rest pass through)."""
from __future__ import annotations

import math

import torch
from torch import nn

from dabba.arch.rope_scaling import RopeScaling
from dabba.ops import native


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling, max_position: int = 0) -> torch.Tensor:
    """[head_dim / 2] (``head_dim``: the rotated dims). Longrope takes its long factors where
    ``max_position`` exceeds the original window (see use_long_factors)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if scaling.rope_type == "longrope":  # as transformers' _compute_longrope_parameters, op for op
        factors = scaling.long_factor if use_long_factors(scaling, max_position) else scaling.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponents)
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    inv_freq = 1.0 / (theta ** exponents)
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "freq_factors":  # llama.cpp's rope_freqs: theta / factor, per frequency
        inv_freq = inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    elif scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def _yarn_inv_freq(dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN, as transformers' _compute_yarn_parameters, op for op: the frequencies that turn more
    than beta_fast times over the original window keep their value, those under beta_slow are
    divided by the factor, a linear ramp between."""
    def correction_dim(rotations: float) -> float:
        window = scaling.original_max_position_embeddings
        return dim * math.log(window / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return 1.0 / (scaling.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def use_long_factors(scaling: RopeScaling, max_position: int) -> bool:
    """Longrope's choice, fixed for the engine's life: the long factors when a sequence can
    outgrow the original window (max_model_len > original_max_position_embeddings).

    transformers chooses per forward by the sequence's current length (and recomputes the cache
    when a sequence crosses the window), so for sequences of at most
    original_max_position_embeddings tokens it uses the short factors where dabba, serving a
    longer max_model_len, uses the long ones (vLLM switches per batch, by its largest position).
    A max_model_len within the window gives the short factors, exactly as transformers computes
    such sequences."""
    return max_position > scaling.original_max_position_embeddings


def describe_longrope(scaling: RopeScaling, max_position: int) -> str:
    original = scaling.original_max_position_embeddings
    if use_long_factors(scaling, max_position):
        return (f"longrope: the long factors for every sequence (max_model_len {max_position} > "
                f"original_max_position_embeddings {original}); transformers uses the short ones for "
                f"sequences of at most {original} tokens")
    return (f"longrope: the short factors (max_model_len {max_position} <= original_max_position_embeddings "
            f"{original}), as transformers for sequences this short")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of ``rotary_dim`` columns (the head_dim, or its rotated part) for positions
    below ``max_position``; longrope's and yarn's attention factor is folded into them, as transformers does."""

    def __init__(self, rotary_dim: int, max_position: int, theta: float, scaling: RopeScaling) -> None:
        super().__init__()
        device = torch.get_default_device()  # the model's (a `with torch.device(...)` around its construction)
        with torch.device("cpu"):  # on the meta device (dabba.models.sizes) these ops would import torch._dynamo: 1-3 s
            inv_freq = rope_inv_freq(rotary_dim, theta, scaling, max_position)
            freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, rotary_dim]
            cos, sin = emb.cos(), emb.sin()
            if scaling.rope_type in ("longrope", "yarn"):
                cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
        self.register_buffer("cos_cache", cos.to(device), persistent=False)
        self.register_buffer("sin_cache", sin.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Once per step, shared by every layer: [num_tokens, rotary_dim] each, in the model dtype."""
        return self.cos_cache[positions].to(dtype), self.sin_cache[positions].to(dtype)


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen2.5-VL's multimodal RoPE: the rotary frequencies in three runs (scaling.mrope_section),
    the first turned by a token's temporal position, the second by its height, the third by its
    width. A text token's three positions are equal (plain RoPE at that position); an image
    token's are its frame and place in the image (worker/mrope_positions.py)."""

    def __init__(self, rotary_dim: int, max_position: int, theta: float, scaling: RopeScaling) -> None:
        super().__init__(rotary_dim, max_position, theta, scaling)
        runs = [c for c, n in enumerate(scaling.mrope_section) for _ in range(n)]  # [rotary_dim / 2]
        self.register_buffer("component", torch.tensor(runs * 2, device=self.cos_cache.device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions``: [3, num_tokens] (temporal, height, width), or [num_tokens] where all three
        are equal."""
        if positions.ndim == 1:
            return super().cos_sin(positions, dtype)
        rows = positions[self.component].T.contiguous()  # [num_tokens, rotary_dim]: the table row of each column
        columns = torch.arange(rows.shape[1], device=rows.device)
        return self.cos_cache[rows, columns].to(dtype), self.sin_cache[rows, columns].to(dtype)


class LayerTypeRotary(nn.Module):
    """RoPE tables per attention kind, for families whose sliding layers rotate with a base of their
    own (Gemma 3: rope_local_base_freq, default rope; its global layers take rope_theta and the
    rope scaling). ``cos_sin`` returns {"full_attention": (cos, sin), "sliding_attention": (cos, sin)},
    the two the same tables where ``local_theta`` is None; each layer takes its kind's."""

    def __init__(self, rotary_dim: int, max_position: int, theta: float, scaling: RopeScaling,
                 local_theta: float | None) -> None:
        super().__init__()
        self.full = RotaryEmbedding(rotary_dim, max_position, theta, scaling)
        self.sliding = (None if local_theta is None
                        else RotaryEmbedding(rotary_dim, max_position, local_theta, RopeScaling()))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        full = self.full.cos_sin(positions, dtype)
        sliding = full if self.sliding is None else self.sliding.cos_sin(positions, dtype)
        return {"full_attention": full, "sliding_attention": sliding}


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim]; cos/sin
    [num_tokens, rotary_dim]: the first rotary_dim dims of each head rotate, the rest pass through.

    On CPU the native kernel rotates in place (q and k may be views into the fused qkv output;
    with a partial rotary_dim it gets views of each head's first rotary_dim dims).
    """
    cos, sin = cos_sin
    rotary_dim = cos.shape[-1]
    partial = rotary_dim != q.shape[-1]
    if q.stride(-1) == 1 and k.stride(-1) == 1 and native.use_cpu_kernels(q):
        if partial:  # each head's first rotary_dim dims, rotated in place through views
            torch.ops.dabba_cpu.rotary_embedding(q[..., :rotary_dim], k[..., :rotary_dim], cos, sin)
        else:
            torch.ops.dabba_cpu.rotary_embedding(q, k, cos, sin)
        return q, k
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if not partial:
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    return (torch.cat((q_rot * cos + _rotate_half(q_rot) * sin, q_pass), dim=-1),
            torch.cat((k_rot * cos + _rotate_half(k_rot) * sin, k_pass), dim=-1))


def apply_rotary_float32(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary as transformers' vision towers rotate: in float32, rounded once to q's dtype
    (cos/sin float32 [num_tokens, head_dim]); in place by the native kernel where it runs."""
    if q.stride(-1) == 1 and k.stride(-1) == 1 and native.use_cpu_kernels(q) and cos.is_contiguous():
        torch.ops.dabba_cpu.rotary_embedding(q, k, cos, sin)
        return q, k
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return tuple((t.float() * cos + _rotate_half(t.float()) * sin).to(t.dtype) for t in (q, k))
