"""RoPE as a config.json spells it (arch/config.py reads the rest): its parameters per layer type,
its scaling (which kinds dabba computes, and each kind's parameters read as transformers reads them)."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

LAYER_TYPES = ("full_attention", "sliding_attention")


def rope_parameters(arch: str, cfg: dict[str, Any], layer_types: list[str] | None) -> tuple[dict, dict | None]:
    """(the RoPE of the global layers, of the sliding layers where it differs (Gemma 3), else None),
    each a rope_parameters dict with its rope_theta, from either spelling: transformers >= 5's
    rope_parameters (flat, or keyed by layer type) or the older rope_theta + rope_scaling (and
    Gemma 3's rope_local_base_freq for its sliding layers)."""
    params = cfg.get("rope_parameters")
    nested = isinstance(params, dict) and any(t in params for t in LAYER_TYPES)
    if nested and set(params) - set(LAYER_TYPES):
        raise ValueError(f"rope_parameters mixes per-layer-type entries with others: {sorted(params)}")
    if arch == "Gemma3ForCausalLM":
        if params and not nested:
            raise ValueError("Gemma 3's rope_parameters must be keyed by layer type (full_attention, "
                             "sliding_attention); transformers ignores a flat one")
        if nested:
            full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
        else:
            full, local = dict(cfg.get("rope_scaling") or {}), {}
        if full.get("rope_theta") is None:  # (transformers 5 writes the top-level ones as null)
            full["rope_theta"] = cfg.get("rope_theta") or 1_000_000.0
        if local.get("rope_theta") is None:
            local["rope_theta"] = cfg.get("rope_local_base_freq") or 10_000.0
        local_type = local.get("rope_type", local.get("type", "default"))
        if local_type != "default" or set(local) - {"rope_type", "type", "rope_theta"}:
            raise ValueError(f"unsupported rope_parameters for Gemma 3's sliding_attention layers: {local!r} "
                             "(only the default rope with its own rope_theta)")
        return full, local
    if nested:
        kinds = {t: params[t] for t in (layer_types or LAYER_TYPES) if t in params}
        if len({json.dumps(p, sort_keys=True) for p in kinds.values()}) > 1:
            raise ValueError(f"unsupported config: rope_parameters differ by layer type for {arch}: {params!r}")
        params = next(iter(kinds.values()), {})
    rope = dict(params or cfg.get("rope_scaling") or {})
    if rope.get("rope_theta") is None:
        rope["rope_theta"] = cfg.get("rope_theta") or 10000.0
    return rope, None

# freq_factors: llama.cpp's rope_freqs (a GGUF file's per-frequency divisors, as its converter
# writes Llama 3's scaling); no Hugging Face config has it
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "freq_factors", "yarn")
# transformers' Phi3Config reads these as longrope ("su": Phi-3's first long-context configs)
PHI3_ROPE_ALIASES = {"su": "longrope", "yarn": "longrope"}
PHI3_ROPE_TYPES = ("default", "longrope")  # all that transformers' Phi3Config.validate_rope accepts


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3, longrope and yarn
    # longrope: the per-frequency divisors (rotary_dim / 2 each) and the factor cos/sin are
    # multiplied by (transformers' attention_scaling: sqrt(1 + ln(factor) / ln(original)) unless given;
    # yarn's: 0.1 ln(factor) + 1 unless given, or from its mscale and mscale_all_dim)
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    # yarn: the ramp between extrapolated and interpolated frequencies, in rotations over the
    # original window (transformers' beta_fast, beta_slow; truncate rounds its ends outward)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    freq_factors: tuple[float, ...] = ()  # freq_factors: each frequency's divisor (rotary_dim / 2 of them)
    # multimodal RoPE (Qwen2.5-VL's M-RoPE): the rotary frequencies split into runs of these sizes
    # (summing to rotary_dim / 2), turned by a token's temporal, height and width position in turn;
    # empty: one position turns them all
    mrope_section: tuple[int, ...] = ()


def rope_scaling(arch: str, cfg: dict[str, Any], rope: dict[str, Any], head_dim: int,
                 max_position_embeddings: int) -> tuple[RopeScaling, int | None]:
    """The scaling of ``rope`` (the global layers' rope_parameters) and the rotated dims (None: the
    whole head); a ValueError naming what dabba does not compute."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "mrope":  # (older Qwen2-VL configs: default frequencies, turned as mrope_section says)
        rope_type = "default"
    supported = ROPE_TYPES
    if arch == "Phi3ForCausalLM":
        rope_type, supported = PHI3_ROPE_ALIASES.get(rope_type, rope_type), PHI3_ROPE_TYPES
    if rope_type not in supported:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r} for {arch}; supported: {supported}")
    partial_rotary_factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if partial_rotary_factor != 1.0 and arch != "Phi3ForCausalLM":  # their transformers classes ignore it
        raise ValueError(f"unsupported config: partial_rotary_factor != 1 for {arch}")
    rotary_dim = _rotary_dim(head_dim, partial_rotary_factor)
    if rope_type == "longrope":
        scaling = _longrope_scaling(arch, cfg, rope, rotary_dim or head_dim, max_position_embeddings)
    elif rope_type == "yarn":
        scaling = _yarn_scaling(rope, max_position_embeddings)
    else:
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
            freq_factors=tuple(float(x) for x in rope.get("freq_factors", ())),
        )
        if rope_type == "freq_factors" and len(scaling.freq_factors) != (rotary_dim or head_dim) // 2:
            raise ValueError(f"rope freq_factors has {len(scaling.freq_factors)} values, not "
                             f"{(rotary_dim or head_dim) // 2} (one per rotary frequency)")
    section = rope.get("mrope_section")
    if section is not None:
        half = (rotary_dim or head_dim) // 2
        if not (isinstance(section, list) and len(section) == 3 and all(isinstance(n, int) and n > 0 for n in section)
                and sum(section) == half):
            raise ValueError(f"mrope_section must be three positive sizes summing to {half} (half the rotated "
                             f"dims), got {section!r}")
        scaling = dataclasses.replace(scaling, mrope_section=tuple(section))
    return scaling, rotary_dim


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


def _yarn_scaling(rope: dict[str, Any], max_position_embeddings: int) -> RopeScaling:
    """YaRN (Qwen2.5/Qwen3 long context, DeepSeek) as transformers' _compute_yarn_parameters reads it."""
    original = int(rope.get("original_max_position_embeddings") or max_position_embeddings)
    factor = rope.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeScaling(rope_type="yarn", factor=factor, original_max_position_embeddings=original,
                       attention_factor=float(attention_factor), beta_fast=float(rope.get("beta_fast") or 32),
                       beta_slow=float(rope.get("beta_slow") or 1), truncate=bool(rope.get("truncate", True)))
