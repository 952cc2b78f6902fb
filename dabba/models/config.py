"""Normalise a Hugging Face config.json once, so model code never guesses defaults."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# transformers' Phi3Config reads these as longrope ("su": Phi-3's first long-context configs)
PHI3_ROPE_ALIASES = {"su": "longrope", "yarn": "longrope"}
PHI3_ROPE_TYPES = ("default", "longrope")  # all that transformers' Phi3Config.validate_rope accepts


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 and longrope
    # longrope: the per-frequency divisors (rotary_dim / 2 each) and the factor cos/sin are
    # multiplied by (transformers' attention_scaling: sqrt(1 + ln(factor) / ln(original)) unless given)
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2 always; others per attention_bias)
    o_bias: bool  # o_proj carries a bias (attention_bias in Llama/Mistral/Qwen3, never Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    quantization_config: dict | None = None  # a pre-quantized checkpoint's (GPTQ, AWQ)
    # RoPE rotates the first rotary_dim dims of each head (head_dim * partial_rotary_factor,
    # Phi-4-mini: 0.75); the rest pass through. None: the whole head.
    rotary_dim: int | None = None
    # Which layers attend within sliding_window, one flag per layer; None: every layer (Mistral,
    # Phi-3). Qwen2/3: their layer_types, by default the layers from max_window_layers on.
    sliding_layers: tuple[bool, ...] | None = None

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """Layer ``layer_idx``'s attention window in keys (a query sees itself and the window - 1
        keys before it), or None where it attends the whole context."""
        if self.sliding_window is None or (self.sliding_layers is not None and not self.sliding_layers[layer_idx]):
            return None
        return self.sliding_window

    @property
    def missing_native_form(self) -> str | None:
        """Why this family's layers have no form in the native layer loop (csrc/decode_cpu.cpp runs
        the Llama block: RMSNorm, SwiGLU, RoPE on each head's first rotary_dim dims with the cos/sin
        tables Python computes (so partial rotary and longrope), optional q/k/v and o biases); None
        where they have one. A family adding a feature the loop lacks says so here."""
        if self.qk_norm:
            return f"{self.architecture}'s per-head q/k RMSNorm is not in the native loop"
        return None

    @classmethod
    def from_hf(cls, model_dir: str | Path) -> "ArchConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no config.json: is it a Hugging Face model directory?")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ArchConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            remote = " (its config asks for remote code via auto_map, which dabba never runs)" if "auto_map" in cfg else ""
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}{remote}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}: only 'silu' (SwiGLU) is supported")
        if cfg.get("mlp_bias"):
            raise ValueError("unsupported config: mlp_bias=true")
        quantization = cfg.get("quantization_config")
        if quantization and quantization.get("quant_method") not in ("gptq", "awq"):
            raise ValueError(f"unsupported quantization_config {quantization.get('quant_method')!r} "
                             "(supported: 'gptq', 'awq')")

        num_heads = cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads

        # transformers >= 5 writes rope_parameters (with rope_theta inside); older: rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        supported = ROPE_TYPES
        if arch == "Phi3ForCausalLM":
            rope_type, supported = PHI3_ROPE_ALIASES.get(rope_type, rope_type), PHI3_ROPE_TYPES
        if rope_type not in supported:
            raise ValueError(f"unsupported rope_scaling type {rope_type!r} for {arch}; supported: {supported}")
        max_position_embeddings = cfg.get("max_position_embeddings", 2048)
        partial_rotary_factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        if partial_rotary_factor != 1.0 and arch != "Phi3ForCausalLM":  # their transformers classes ignore it
            raise ValueError(f"unsupported config: partial_rotary_factor != 1 for {arch}")
        rotary_dim = _rotary_dim(head_dim, partial_rotary_factor)
        if rope_type == "longrope":
            scaling = _longrope_scaling(arch, cfg, rope, rotary_dim or head_dim, max_position_embeddings)
        else:
            scaling = RopeScaling(
                rope_type=rope_type,
                factor=float(rope.get("factor", 1.0)),
                low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
            )

        # Mistral and Phi3 attend within it whenever it is set (transformers masks with it), in every
        # layer; Qwen only with use_sliding_window, in layers max_window_layers.. (transformers'
        # Qwen2Config.layer_types)
        sliding_window = cfg.get("sliding_window")
        sliding_layers = None
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            if not cfg.get("use_sliding_window", False):
                sliding_window = None
            layer_types = cfg.get("layer_types") or [
                "sliding_attention" if i >= cfg.get("max_window_layers", 28) else "full_attention"
                for i in range(cfg["num_hidden_layers"])]
            sliding_layers = tuple(t == "sliding_attention" for t in layer_types)

        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            o_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=sliding_window,
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            quantization_config=quantization or None,
            rotary_dim=rotary_dim,
            sliding_layers=sliding_layers,
        )


def _rotary_dim(head_dim: int, partial_rotary_factor: float) -> int | None:
    """int(head_dim * factor) as transformers computes it; None for the whole head."""
    if not 0.0 < partial_rotary_factor <= 1.0:
        raise ValueError(f"partial_rotary_factor={partial_rotary_factor} must be in (0, 1]")
    rotary_dim = int(head_dim * partial_rotary_factor)
    if rotary_dim == head_dim:
        return None
    if rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor={partial_rotary_factor} of head_dim {head_dim} rotates an odd "
                         f"number of dims ({rotary_dim}); RoPE rotates pairs")
    return rotary_dim


def _longrope_scaling(arch: str, cfg: dict[str, Any], rope: dict[str, Any], rotary_dim: int,
                      max_position_embeddings: int) -> RopeScaling:
    """LongRoPE (Phi-3.5, Phi-4-mini) as transformers' _compute_longrope_parameters reads it."""
    # transformers gives a top-level original_max_position_embeddings priority over the rope dict's;
    # Phi3Config always has one (default 4096), other configs fall back to max_position_embeddings
    original = cfg.get("original_max_position_embeddings")
    if original is None:
        original = 4096 if arch == "Phi3ForCausalLM" else rope.get("original_max_position_embeddings",
                                                                    max_position_embeddings)
    original = int(original)
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = rope.get(key)
        if not isinstance(values, list) or len(values) != rotary_dim // 2:
            raise ValueError(f"longrope's {key} must be a list of rotary_dim / 2 = {rotary_dim // 2} numbers, "
                             f"got {values!r}")
        factors[key] = tuple(float(v) for v in values)
    factor = rope.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(rope_type="longrope", factor=factor, original_max_position_embeddings=original,
                       attention_factor=float(attention_factor), **factors)
