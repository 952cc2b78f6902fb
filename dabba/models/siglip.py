"""SigLIP's vision tower (Gemma 3's) and CLIP's (LLaVA's): pixel values -> one hidden state per
patch. The patch embedding is a convolution whose stride is its kernel, so it runs as one linear
over the flattened patches; learnt positions; pre-norm layers, x += attention(LN(x)),
x += fc2 act(fc1 LN(x)), every linear with a bias, every token attending to all of its image's;
a final LN. CLIP puts a class token before the patches and a LayerNorm before the layers, and
LLaVA reads an earlier layer's states (``num_layers``). The attention-pooling head of
SiglipVisionModel is not read: multimodal models take the patches' states."""
from __future__ import annotations

from typing import Generator, Hashable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from dabba.arch.vision_config import VisionConfig
from dabba.layers.encoder_attention import dense_attention
from dabba.models.encoder_steps import row_chunks, run_steps
from dabba.models.vision_language import check_complete, copy_checked


class SiglipLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.activation = ACTIVATIONS[cfg.activation]
        self.layer_norm1 = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.qkv = nn.Linear(h, 3 * h)
        self.out_proj = nn.Linear(h, h)
        self.layer_norm2 = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(h, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, h)

    def steps(self, x: torch.Tensor, chunk_rows: int | None) -> Iterator[float]:
        """The layer on x [num_images, num_patches, hidden], in place, in units of ``chunk_rows``
        patches (None: all at once): each chunk's q, k and v, then each chunk's attention over all
        the keys and its MLP; each unit's operations yielded before it runs."""
        num_images, num_patches, hidden = x.shape
        qkv = x.new_empty(num_images, num_patches, 3 * hidden)
        chunks = row_chunks(num_patches, chunk_rows)
        for rows in chunks:
            yield num_images * (rows.stop - rows.start) * 6.0 * hidden ** 2
            qkv[:, rows] = self.qkv(self.layer_norm1(x[:, rows]))
        q, k, v = (t.view(num_images, num_patches, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in qkv.chunk(3, dim=-1))
        for rows in chunks:
            yield num_images * (rows.stop - rows.start) * (4.0 * num_patches * hidden + 2.0 * hidden ** 2
                                                           + 4.0 * hidden * self.fc1.out_features)
            attended = dense_attention(q[:, :, rows], k, v, self.head_dim ** -0.5)
            y = x[:, rows] + self.out_proj(attended.reshape(num_images, -1, hidden))
            x[:, rows] = y + self.fc2(self.activation(self.fc1(self.layer_norm2(y))))


class SiglipVisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embedding = nn.Linear(cfg.num_channels * cfg.patch_size ** 2, cfg.hidden_size, bias=not cfg.clip)
        self.position_embedding = nn.Embedding(cfg.num_positions, cfg.hidden_size)
        if cfg.clip:
            self.class_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
            self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)  # (CLIP's spelling)
        self.layers = nn.ModuleList(SiglipLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, num_layers: int | None = None) -> torch.Tensor:
        """[num_images, channels, image_size, image_size] -> [num_images, num_positions, hidden]:
        the last layer's states (after the final LN in SigLIP; CLIP's applies to its pooled class
        token only), or with ``num_layers`` the states after that many layers (transformers'
        hidden_states[num_layers]), with no final LN."""
        return run_steps(self.steps(pixel_values, num_layers))

    def steps(self, pixel_values: torch.Tensor, num_layers: int | None = None,
              chunk_rows: int | None = None) -> Generator[float, None, torch.Tensor]:
        """forward() in units (models/vision_language.py: encoder steps), each layer's in chunks
        of ``chunk_rows`` patches."""
        cfg = self.config
        num_images, channels, height, width = pixel_values.shape
        if (height, width) != (cfg.image_size, cfg.image_size) or channels != cfg.num_channels:
            raise ValueError(f"the vision tower reads {cfg.num_channels} x {cfg.image_size} x {cfg.image_size} pixels, "
                             f"got {channels} x {height} x {width}")
        p, side = cfg.patch_size, cfg.image_size // cfg.patch_size
        # [num_images, channels, side, p, side, p] -> patches in row-major order, each (channel, row, col)
        patches = (pixel_values.to(self.position_embedding.weight.dtype).view(num_images, channels, side, p, side, p)
                   .permute(0, 2, 4, 1, 3, 5).reshape(num_images, side * side, channels * p * p))
        x = self.patch_embedding(patches)
        if cfg.clip:
            x = torch.cat([self.class_embedding.expand(num_images, 1, -1), x], dim=1)
        x = x + self.position_embedding.weight
        if cfg.clip:
            x = self.pre_layrnorm(x)
        for layer in self.layers[:num_layers]:
            yield from layer.steps(x, chunk_rows)
        return self.post_layernorm(x) if num_layers is None and not cfg.clip else x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], prefix: str = "") -> None:
        """SiglipVisionModel's tensors: those under ``prefix`` (a multimodal checkpoint's vision
        tower's, e.g. "vision_tower."), past a "vision_model." (older transformers wrote it); q, k
        and v into the merged qkv; the pooling head not read. Fails on unexpected or missing tensors."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        loaded: set[str] = set()
        unexpected = []
        for name, tensor in weights:
            if not name.startswith(prefix):
                continue
            target, shard = _target(name.removeprefix(prefix).removeprefix("vision_model."))
            if target is None:
                continue
            if target not in params:
                unexpected.append(name)
                continue
            if shard is not None:  # q, k, v wait for each other
                pending.setdefault(target, {})[shard] = tensor
                if len(pending[target]) < 3:
                    continue
                shards = pending.pop(target)
                tensor = torch.cat([shards[s] for s in ("q", "k", "v")])
            elif target.endswith("patch_embedding.weight"):
                tensor = tensor.reshape(tensor.shape[0], -1)  # the convolution's kernel, flattened as patches are
            copy_checked(params[target], tensor, name)
            loaded.add(target)
        check_complete(params, loaded, unexpected)


ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
               "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}  # arch/vision_config.VISION_ACTIVATIONS
_QKV = {"self_attn.q_proj.": "q", "self_attn.k_proj.": "k", "self_attn.v_proj.": "v"}


def _target(name: str) -> tuple[str | None, Hashable]:
    if name.startswith("head.") or name.endswith("position_ids"):
        return None, None
    name = name.replace("embeddings.", "").replace("encoder.layers.", "layers.")
    for theirs, shard in _QKV.items():
        if theirs in name:
            return name.replace(theirs, "qkv."), shard
    return name.replace("self_attn.out_proj.", "out_proj.").replace("mlp.", ""), None
