"""Qwen2.5-VL's vision tower: an image's flat patches (multimodal/qwen_image_processor.py) -> one
embedding per merge group of patches, at the language model's width.

The patch embedding is a 3-D convolution whose stride is its kernel: one linear over the flattened
patches. Rotary positions in two halves (a patch's row, its column); pre-norm layers with RMSNorm,
x += proj(attention(norm1 x)), x += down(silu(gate) * up)(norm2 x), every linear with a bias. The
tokens run in window order: the merge groups of each window_size square together, so that the
windowed layers attend within contiguous runs (windows of one size batched in one attention
call), the fullatt_block_indexes layers over the whole image. The merger (RMSNorm, then each merge
group's patches concatenated through linear, GELU, linear) ends it, and the window order is undone."""
from __future__ import annotations

from typing import Generator, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dabba.arch.qwen_vision_config import QwenVisionConfig
from dabba.layers.encoder_attention import dense_attention
from dabba.layers.layernorm import RMSNorm
from dabba.layers.rotary import apply_rotary_float32
from dabba.models.encoder_steps import row_chunks, run_steps
from dabba.models.vision_language import check_complete, copy_checked, split_vision_tensors
from dabba.multimodal.qwen_image_processor import VisionPatches

NORM_EPS = 1e-6  # transformers' Qwen2.5-VL vision norms


def window_order(grid: tuple[int, int, int], merge: int, window: int) -> tuple[np.ndarray, list[int]]:
    """(the merge groups in window order, each window's length in merge groups): windows of
    ``window`` x ``window`` groups row by row over each frame, cut short at the grid's edges."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    index = np.arange(t * h * w).reshape(t, h, w)
    order, lengths = [], []
    for frame in range(t):
        for top in range(0, h, window):
            for left in range(0, w, window):
                block = index[frame, top:top + window, left:left + window].reshape(-1)
                order.append(block)
                lengths.append(len(block))
    return np.concatenate(order), lengths


def patch_positions(grid: tuple[int, int, int], merge: int) -> np.ndarray:
    """[t * h * w, 2]: each patch's (row, column), patches in merge-group order."""
    t, h, w = grid
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    rows, cols = (a.reshape(shape).transpose(0, 2, 1, 3).reshape(-1) for a in (rows, cols))
    return np.tile(np.stack([rows, cols], axis=-1), (t, 1))


class QwenVisionAttention(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rows' [3, rows, heads, head_dim] q, k (rotated in float32, as transformers does) and v."""
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rotary_float32(q, k, cos, sin)
        return torch.stack([q, k, v])

    def attend(self, qkv: torch.Tensor, unit: list[tuple[int, int, int, int]]) -> torch.Tensor:
        """A unit's queries (one contiguous run of rows) over their keys: [rows, hidden], projected.
        ``unit``: (query start, queries, key start, keys) per run, runs of one shape batched."""
        first = unit[0][0]
        out = qkv.new_empty(sum(n for _, n, _, _ in unit), self.num_heads, self.head_dim)
        device = qkv.device
        for shape in sorted({(n, m) for _, n, _, m in unit}):
            runs = [(qs, ks) for qs, n, ks, m in unit if (n, m) == shape]
            queries = torch.tensor([qs for qs, _ in runs], device=device)[:, None] + torch.arange(shape[0], device=device)
            keys = torch.tensor([ks for _, ks in runs], device=device)[:, None] + torch.arange(shape[1], device=device)
            out[queries - first] = dense_attention(qkv[0, queries].transpose(1, 2), qkv[1, keys].transpose(1, 2),
                                                   qkv[2, keys].transpose(1, 2), self.head_dim ** -0.5)
        return self.proj(out.flatten(1))


class QwenVisionMLP(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QwenVisionBlock(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, NORM_EPS)
        self.norm2 = RMSNorm(cfg.hidden_size, NORM_EPS)
        self.attn = QwenVisionAttention(cfg)
        self.mlp = QwenVisionMLP(cfg)

    def steps(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], segments: list[tuple[int, int]],
              chunk_rows: int | None) -> Iterator[float]:
        """The block on x [patches, hidden], in place, tokens attending within ``segments``
        ((start, length) runs): q, k, v a chunk of rows at a time, then attention and MLP a unit of
        whole segments (or of one long segment's queries) at a time; each unit's operations
        yielded before it runs."""
        hidden = x.shape[1]
        qkv = x.new_empty(3, x.shape[0], self.attn.num_heads, self.attn.head_dim)
        cos, sin = rope
        for rows in row_chunks(x.shape[0], chunk_rows):
            yield (rows.stop - rows.start) * 6.0 * hidden ** 2
            qkv[:, rows] = self.attn.project(self.norm1(x[rows]), cos[rows], sin[rows])
        for unit in attention_units(segments, chunk_rows):
            rows = slice(unit[0][0], unit[-1][0] + unit[-1][1])
            yield sum(n * (4.0 * m * hidden + 2.0 * hidden ** 2 + 6.0 * hidden * self.mlp.up_proj.out_features)
                      for _, n, _, m in unit)
            y = x[rows] + self.attn.attend(qkv, unit)
            x[rows] = y + self.mlp(self.norm2(y))


def attention_units(segments: list[tuple[int, int]], chunk_rows: int | None) -> list[list[tuple[int, int, int, int]]]:
    """Consecutive segments grouped into units of at most ``chunk_rows`` queries (None: one unit),
    a longer segment's queries split over units of their own, each over all its keys:
    (query start, queries, key start, keys) per run."""
    units: list[list[tuple[int, int, int, int]]] = []
    current: list[tuple[int, int, int, int]] = []
    for start, length in segments:
        if chunk_rows is not None and length > chunk_rows:
            units += [current] if current else []
            current = []
            units += [[(q, min(chunk_rows, start + length - q), start, length)]
                      for q in range(start, start + length, chunk_rows)]
            continue
        if current and chunk_rows is not None and sum(n for _, n, _, _ in current) + length > chunk_rows:
            units.append(current)
            current = []
        current.append((start, length, start, length))
    return units + ([current] if current else [])


class QwenPatchMerger(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.group = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.ln_q = RMSNorm(cfg.hidden_size, NORM_EPS)
        self.mlp = nn.Sequential(nn.Linear(self.group, self.group), nn.GELU(), nn.Linear(self.group, cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.group))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.patch_values, cfg.hidden_size, bias=False)  # the convolution, flattened


class Qwen2_5VisionTower(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(QwenVisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = QwenPatchMerger(cfg)
        quarter = cfg.head_dim // 2
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float)
                                                                  / quarter), persistent=False)

    def forward(self, image: VisionPatches) -> torch.Tensor:
        """-> [merge groups, out_hidden_size]: the image's tokens in the language model, in order."""
        return run_steps(self.steps(image))

    def steps(self, image: VisionPatches, chunk_rows: int | None = None) -> Generator[float, None, torch.Tensor]:
        """forward() in units (models/encoder_steps.py)."""
        cfg = self.config
        grid, unit = image.grid, cfg.spatial_merge_size ** 2
        if image.patches.shape != (int(np.prod(grid)), cfg.patch_values):
            raise ValueError(f"patches {image.patches.shape} do not match a grid of {grid} patches of "
                             f"{cfg.patch_values} values")
        device = self.inv_freq.device
        order, lengths = window_order(grid, cfg.spatial_merge_size, cfg.window_merges)
        patch_order = torch.from_numpy((order[:, None] * unit + np.arange(unit)).reshape(-1)).to(device)
        dtype = self.merger.ln_q.weight.dtype  # the model's (the linears may be W8A8's)
        x = self.patch_embed.proj(torch.from_numpy(image.patches).to(device, dtype))[patch_order]
        positions = torch.from_numpy(patch_positions(grid, cfg.spatial_merge_size)).to(device)[patch_order]
        freqs = (positions[..., None].float() * self.inv_freq).flatten(1)  # [patches, head_dim / 2]: rows', columns'
        angles = torch.cat([freqs, freqs], dim=-1)
        rope = (angles.cos(), angles.sin())
        frame = grid[1] * grid[2]
        full = [(start, frame) for start in range(0, grid[0] * frame, frame)]
        windows = list(zip(np.cumsum([0, *lengths[:-1]]) * unit, np.array(lengths) * unit))
        for i, block in enumerate(self.blocks):
            yield from block.steps(x, rope, full if i in cfg.fullatt_block_indexes else windows, chunk_rows)
        merged = self.merger(x)
        return merged[torch.from_numpy(np.argsort(order)).to(device)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's vision tensors (visual.*, its merger included)."""
        tower, projector = split_vision_tensors(weights)
        params = dict(self.named_parameters())
        loaded, unexpected = set(), sorted(projector)
        for name, tensor in tower:
            if name not in params:
                unexpected.append(name)
                continue
            if name == "patch_embed.proj.weight":
                tensor = tensor.reshape(tensor.shape[0], -1)  # [hidden, channels, frames, p, p], flattened as patches are
            copy_checked(params[name], tensor, f"visual.{name}")
            loaded.add(name)
        check_complete(params, loaded, unexpected)
