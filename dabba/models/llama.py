"""Llama family: Llama, Mistral, Qwen2 (q/k/v bias) and Phi-3 (fused checkpoint tensors, partial
rotary, longrope: all in ArchConfig and the loader) share this code; Qwen3 and Gemma subclass it.

Weights arrive under the Hugging Face names; q/k/v and gate/up are merged into one GEMM each.
Under tensor parallelism q/k/v and gate/up are column-parallel (each rank its heads and its part
of the intermediate channels), o_proj and down_proj row-parallel (summed over the ranks).
"""
from __future__ import annotations

from typing import Callable, Hashable, Iterable

import torch
from torch import nn

from dabba.arch.checkpoint_names import checkpoint_target
from dabba.arch.config import ArchConfig
from dabba.distributed.tensor_parallel import KVHeadShard, current_tensor_parallel
from dabba.layers.attention import Attention
from dabba.layers.embedding import EmbeddingRows, LMHead, VocabEmbedding
from dabba.layers.layernorm import RMSNorm
from dabba.layers.linear import Linear
from dabba.layers.native_form import NativeLayer, NativeMLP, NativeQKNorm
from dabba.layers.rotary import MRotaryEmbedding, RotaryEmbedding, apply_rotary
from dabba.quantization.config import QuantConfig

class LlamaMLP(nn.Module):
    """down(act(gate) * up): SwiGLU, or GeGLU where cfg.mlp_activation says (Gemma)."""

    def __init__(self, cfg: ArchConfig, prefix: str, quant_config: QuantConfig | None) -> None:
        super().__init__()
        self.activation = cfg.mlp_activation
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, [inter, inter], shard_ids=(0, 1), prefix=f"{prefix}.gate_up_proj",
                                   quant_config=quant_config, parallel="column")
        self.down_proj = Linear(inter, [cfg.hidden_size], prefix=f"{prefix}.down_proj", quant_config=quant_config,
                                parallel="row")

    def native_mlp(self) -> NativeMLP:
        return NativeMLP(gate_up=self.gate_up_proj, down=self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x, act_and_mul=self.activation))


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int, prefix: str, quant_config: QuantConfig | None) -> None:
        super().__init__()
        tp = current_tensor_parallel()
        self.num_heads = tp.split(cfg.num_attention_heads, "num_attention_heads")  # this rank's
        kv = KVHeadShard.of(tp.rank, tp.size, cfg.num_key_value_heads)
        self.num_kv_heads = kv.num_local
        self.head_dim = d = cfg.head_dim
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        full_q, full_kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        self.qkv_proj = Linear(
            cfg.hidden_size, [full_q, full_kv, full_kv], bias=cfg.qkv_bias, shard_ids=("q", "k", "v"),
            prefix=f"{prefix}.qkv_proj", quant_config=quant_config, parallel="column",
            output_slices=[(tp.rank * self.q_size, self.q_size)] + [(kv.first * d, self.kv_size)] * 2,
        )
        self.o_proj = Linear(full_q, [cfg.hidden_size], bias=cfg.o_bias, prefix=f"{prefix}.o_proj",
                             quant_config=quant_config, parallel="row")
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, layer_idx,
                              cfg.layer_sliding_window(layer_idx), cfg.attn_scale, cfg.attn_logit_softcapping)

    def native_qk_norm(self) -> NativeQKNorm | None:
        """Llama normalises neither q nor k (norm_qk below)."""
        return None

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook for families that normalise q/k per head before RoPE (Qwen3)."""
        return q, k

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.norm_qk(q, k)
        q, k = apply_rotary(q, k, rope)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, cfg: ArchConfig, layer_idx: int, prefix: str, quant_config: QuantConfig | None) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(cfg, layer_idx, f"{prefix}.self_attn", quant_config)
        self.mlp = self.make_mlp(cfg, layer_idx, f"{prefix}.mlp", quant_config)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_mlp(self, cfg: ArchConfig, layer_idx: int, prefix: str, quant_config: QuantConfig | None) -> nn.Module:
        """The layer's feed-forward block (a mixture of experts in the MoE families)."""
        return LlamaMLP(cfg, prefix, quant_config)

    def native_form(self) -> NativeLayer:
        """forward() below, as the native loop runs it."""
        attn = self.self_attn
        return NativeLayer(self.input_layernorm, self.post_attention_layernorm, attn.qkv_proj, attn.o_proj, attn.attn,
                           self.mlp.native_mlp(), attn.native_qk_norm())

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the next norm adds them."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    norm_cls: type[nn.Module] = RMSNorm

    def __init__(self, cfg: ArchConfig, max_position: int, layer_cls: type[LlamaDecoderLayer],
                 quant_config: QuantConfig | None, prefix: str = "model") -> None:
        super().__init__()
        self.embed_tokens = self.make_embedding(cfg)
        self.rotary = self.make_rotary(cfg, max_position)
        self.layers = nn.ModuleList(layer_cls(cfg, i, f"{prefix}.layers.{i}", quant_config)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)

    def make_embedding(self, cfg: ArchConfig) -> VocabEmbedding:
        return VocabEmbedding(cfg.vocab_size, cfg.hidden_size)

    def make_rotary(self, cfg: ArchConfig, max_position: int) -> nn.Module:
        if cfg.rope_scaling.mrope_section:
            return MRotaryEmbedding(cfg.rotary_dim or cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        return RotaryEmbedding(cfg.rotary_dim or cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor, image_embeds: EmbeddingRows | None = None
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The layers' inputs: embedded tokens [num_tokens, hidden] (images' rows in place of
        their placeholders') and RoPE's (cos, sin) (the native layer loop starts from here too)."""
        x = self.embed_tokens(input_ids)
        if image_embeds is not None:
            x = image_embeds.scatter(x)
        return x, self.rotary.cos_sin(positions, x.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                image_embeds: EmbeddingRows | None = None) -> torch.Tensor:
        x, rope = self.embed(input_ids, positions, image_embeds)
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    model_cls: type[nn.Module] = LlamaModel
    layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, cfg: ArchConfig, max_position: int, quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.model_cls(cfg, max_position, self.layer_cls, quant_config)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size,
                              quant_config.get_lm_head_method() if quant_config else None)
        if cfg.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def native_layers(self) -> list[NativeLayer]:
        """Every decoder layer's native form (raises NoNativeForm saying why where one has none)."""
        return [layer.native_form() for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     on_loaded: Callable[[str, Hashable], None] | None = None) -> None:
        """Copy checkpoint tensors in; fail loudly on unexpected or missing ones. A merged layer's
        tensor arrives per shard (q_proj, k_proj, v_proj) or already fused under the merged name
        (Phi-3's qkv_proj, gate_up_proj: [q; k; v] and [gate; up] rows), which fills every shard.

        ``on_loaded(parameter name, shard id)`` follows every copy (shard id None: the whole
        parameter), so the loader can repack a layer as soon as it is complete. Parameters are
        looked up per tensor, never held: a layer's repacking frees its full-precision weight."""
        names = self.checkpoint_parameters()
        known = set(names)
        loaded: set[str] = set()
        unexpected = []
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # derived from the config, not a weight
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints store it anyway
            target, shard_id = self.checkpoint_target(name)
            if target not in known:
                unexpected.append(name)
                continue
            self._copy_tensor(name, target, tensor, shard_id)
            loaded.update(self._shard_keys(target, shard_id))
            if on_loaded is not None:
                on_loaded(target, shard_id)
        if unexpected:
            raise ValueError(f"checkpoint has unexpected tensors: {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}")
        expected = set()
        for name in names:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            expected.update(self._shard_keys(name, None))
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {missing[:10]}{' ...' if len(missing) > 10 else ''}")

    def checkpoint_parameters(self) -> list[str]:
        """The parameters the checkpoint's language-model tensors fill (every one, where the model
        is a language model alone)."""
        return [name for name, _ in self.named_parameters(remove_duplicate=False)]

    def checkpoint_target(self, name: str) -> tuple[str, Hashable]:
        """A checkpoint tensor's parameter name and shard id (families with other names override)."""
        return checkpoint_target(name)

    def _copy_tensor(self, name: str, target: str, tensor: torch.Tensor, shard_id: Hashable) -> None:
        """Checkpoint tensor ``name`` into parameter ``target`` (through its weight loader, if any)."""
        module_name, _, attr = target.rpartition(".")
        param = getattr(self.get_submodule(module_name), attr, None)
        if not isinstance(param, nn.Parameter):
            raise ValueError(f"{name}: arrived after {module_name} was complete and repacked (a duplicate tensor?)")
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, tensor, shard_id)
            return
        if param.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint tensor {tuple(tensor.shape)} != expected {tuple(param.shape)}")
        param.data.copy_(tensor)

    def _shard_keys(self, target: str, shard_id: Hashable) -> set[str]:
        """"param#shard" for each shard a tensor fills: the one named, or all of a merged layer's."""
        if shard_id is not None:
            return {f"{target}#{shard_id}"}
        owner = self.get_submodule(target.rsplit(".", 1)[0])
        shard_ids = owner.shard_ids if isinstance(owner, Linear) and owner.shard_ids else (None,)
        return {f"{target}#{sid}" for sid in shard_ids}
