"""Qwen2.5-VL's vision tower (models/qwen2_5_vision.py), as its vision_config says: a ViT over
patch_size squares taken two frames deep (temporal_patch_size; a still image is its own second
frame), at any resolution; each spatial_merge_size x spatial_merge_size group of patches becomes
one of the language model's tokens. Most layers attend within windows of window_size pixels a
side, those fullatt_block_indexes names over the whole image."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class QwenVisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int  # the language model's width (the merger's output)
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    in_channels: int = 3
    rope_theta: float = 10_000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_values(self) -> int:
        """Values in one flattened patch (channels x frames x pixels)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def window_merges(self) -> int:
        """A window's side in merged tokens."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "vision_config") -> "QwenVisionConfig":
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act {act!r} is not supported (Qwen2.5-VL's towers use silu)")
        sizes = {k: cfg.get(k, default) for k, default in (
            ("depth", 32), ("hidden_size", 3584), ("intermediate_size", 3420), ("num_heads", 16),
            ("out_hidden_size", 3584), ("patch_size", 14), ("temporal_patch_size", 2), ("spatial_merge_size", 2),
            ("window_size", 112), ("in_channels", cfg.get("in_chans", 3)))}
        bad = [k for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        if bad:
            raise ValueError(f"{source}: {', '.join(bad)} must be positive integers")
        if sizes["hidden_size"] % sizes["num_heads"] or (sizes["hidden_size"] // sizes["num_heads"]) % 4:
            raise ValueError(f"{source}: hidden_size / num_heads must be a multiple of 4 (its rotary turns height "
                             "and width in halves)")
        if sizes["window_size"] < sizes["patch_size"] * sizes["spatial_merge_size"]:
            raise ValueError(f"{source}: window_size must hold one merged patch group at least")
        full = cfg.get("fullatt_block_indexes", [7, 15, 23, 31])
        if not isinstance(full, list) or not all(isinstance(i, int) and 0 <= i < sizes["depth"] for i in full):
            raise ValueError(f"{source}: fullatt_block_indexes must list layers of the {sizes['depth']}, got {full!r}")
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or 10_000.0
        return cls(**sizes, fullatt_block_indexes=tuple(full), rope_theta=float(theta))
