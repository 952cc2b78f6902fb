"""A GGUF file as the checkpoint files the rest of dabba reads: its metadata mapped to a Hugging
Face config.json (the family and its hyperparameters) and generation_config.json. Its vocabulary
is arch/gguf_tokenizer.py's; the weights stay in the file (models/gguf_checkpoint.py reads them by
their GGUF names).

What dabba cannot map is refused naming it: the architecture, a rope scaling, a count that is not one.
"""
from __future__ import annotations

import math
from typing import Any

from dabba.arch.gguf_file import GGUFFile

# general.architecture -> the transformers class dabba's families are keyed by (llama with
# llama.expert_count is Mixtral)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "phi3": "Phi3ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# general.file_type -> the dtype its float tensors have (the quantized types compute in bfloat16)
FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}
# What llama.cpp assumes where the file is silent (its llama-model.cpp): Gemma 2 slides in every
# other layer within 4096 keys, Gemma 3 in five of every six, its sliding layers with RoPE base 10^4;
# both scale attention by head_dim ** -0.5 but at 27B (Gemma 2: 46 layers, Gemma 3: 62), where
# they scale by (hidden / heads) ** -0.5.
GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA2_WINDOW, GEMMA3_SWA_ROPE_BASE = 4096, 10_000.0
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# which families renormalise their experts' top-k weights, where the file has no expert_weights_norm
EXPERT_WEIGHTS_NORM = {"llama": True, "qwen3moe": True, "olmoe": False}


def _need(f: GGUFFile, key: str, kind: type | tuple[type, ...]) -> Any:
    value = f.require(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{f.path}: metadata {key!r} is {value!r}, not a {getattr(kind, '__name__', kind)}")
    return value


def _size(f: GGUFFile, key: str, default: int | None = None) -> int:
    """A count the model is built from: a positive integer (and not past any model)."""
    value = f.get(key, default) if default is not None else f.require(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 2**31:
        raise ValueError(f"{f.path}: metadata {key!r} is {value!r}, not a positive integer")
    return value


def _float_vector(f: GGUFFile, name: str, length: int) -> list[float]:
    """A small float32 tensor the converter wrote for the config (rope factors)."""
    t = f.tensors.get(name)
    if t is None:
        raise ValueError(f"{f.path}: the GGUF file lacks the tensor {name!r}")
    if t.type_name != "F32" or t.shape != (length,):
        raise ValueError(f"{f.path}: {name} is {t.type_name} {t.shape}, not {length} float32 values")
    return t.data.view("<f4").tolist()


def hf_config(f: GGUFFile) -> dict[str, Any]:
    """config.json's fields for the file's family."""
    arch = f.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{f.path}: GGUF architecture {arch!r} is not one dabba serves from GGUF; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    heads = _size(f, f"{arch}.attention.head_count")
    hidden = _size(f, f"{arch}.embedding_length")
    if "token_embd.weight" not in f.tensors or len(f.tensors["token_embd.weight"].shape) != 2:
        raise ValueError(f"{f.path}: the GGUF file has no token_embd.weight matrix")
    vocab_size = f.tensors["token_embd.weight"].shape[0]  # llama.cpp's n_vocab, as its rows
    if f.get(f"{arch}.vocab_size", vocab_size) != vocab_size:
        raise ValueError(f"{f.path}: {arch}.vocab_size is {f.get(f'{arch}.vocab_size')!r} but token_embd.weight has "
                         f"{vocab_size} rows")
    cfg = {
        "architectures": [ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": _size(f, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _size(f, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _size(f, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _size(f, f"{arch}.attention.key_length", max(hidden // heads, 1)),
        "rms_norm_eps": float(_need(f, f"{arch}.attention.layer_norm_rms_epsilon", (int, float))),
        "max_position_embeddings": _size(f, f"{arch}.context_length"),
        "rope_parameters": _rope(f, arch),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "hidden_act": "silu",
        "dtype": FILE_DTYPES.get(f.get("general.file_type"), "bfloat16"),
        "attention_bias": "blk.0.attn_q.bias" in f.tensors,
    }
    _experts(f, arch, cfg)
    if arch == "phi3":
        _phi3(f, cfg)
    elif arch in GEMMA_SWA_PATTERN:
        _gemma(f, arch, cfg)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        gguf_key = f"tokenizer.ggml.{key.replace('pad_', 'padding_')}"
        if isinstance(f.get(gguf_key), int):
            cfg[key] = f.get(gguf_key)
    return cfg


def _rope(f: GGUFFile, arch: str) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(f.get(f"{arch}.rope.freq_base", 10000.0))}
    scaling = f.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=float(_need(f, f"{arch}.rope.scaling.factor", (int, float))))
    elif scaling == "yarn":
        rope.update(_yarn(f, arch))
    elif scaling != "none" and not (arch == "phi3" and scaling == "longrope"):  # Phi-3's: _phi3
        raise ValueError(f"{f.path}: rope scaling {scaling!r} is not read from GGUF yet (none, linear, yarn, "
                         "Phi-3's longrope and rope_freqs.weight are)")
    if "rope_freqs.weight" in f.tensors:  # Llama 3's scaling, as the converter writes it: a divisor per frequency
        freqs = f.tensors["rope_freqs.weight"]
        if freqs.type_name != "F32" or len(freqs.shape) != 1:
            raise ValueError(f"{f.path}: rope_freqs.weight is {freqs.type_name} {freqs.shape}, not a float32 vector")
        rope.update(rope_type="freq_factors", freq_factors=freqs.data.view("<f4").tolist())
    return rope


def _yarn(f: GGUFFile, arch: str) -> dict[str, Any]:
    """YaRN's parameters as transformers names them, meaning what llama.cpp makes of the file's keys:
    cos and sin scaled by 0.1 ln(factor) + 1 (over yarn_log_multiplier's, where the file has one),
    times rope.scaling.attn_factor."""
    key = f"{arch}.rope.scaling"
    factor = float(_need(f, f"{key}.factor", (int, float)))
    rope: dict[str, Any] = {"rope_type": "yarn", "factor": factor,
                            "original_max_position_embeddings": _size(f, f"{key}.original_context_length")}
    if f.get(f"{key}.yarn_ext_factor", 1.0) != 1.0:
        raise ValueError(f"{f.path}: {key}.yarn_ext_factor {f.get(f'{key}.yarn_ext_factor')!r} is not 1: a partial "
                         "YaRN ramp, which transformers' YaRN has not")

    def number(name: str, default: float) -> float:
        return float(_need(f, f"{key}.{name}", (int, float))) if f.get(f"{key}.{name}") is not None else default

    rope.update(beta_fast=number("yarn_beta_fast", 32.0), beta_slow=number("yarn_beta_slow", 1.0))

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    log_mul = number("yarn_log_multiplier", 0.0)
    rope["attention_factor"] = (mscale(1.0) / mscale(log_mul) if log_mul else mscale(1.0)) * number("attn_factor", 1.0)
    return rope


def _experts(f: GGUFFile, arch: str, cfg: dict[str, Any]) -> None:
    """A mixture of experts' counts (Mixtral: Llama's block with experts); Qwen3-MoE's dense layers
    are those whose block has a plain MLP."""
    if not f.get(f"{arch}.expert_count", 0):
        if arch in ("qwen3moe", "olmoe"):
            raise ValueError(f"{f.path}: a {arch} file without {arch}.expert_count")
        return
    if arch not in EXPERT_WEIGHTS_NORM:
        raise ValueError(f"{f.path}: experts in a {arch} file are not read from GGUF (llama, qwen3moe and olmoe's are)")
    experts, top_k = _size(f, f"{arch}.expert_count"), _size(f, f"{arch}.expert_used_count")
    norm = f.get(f"{arch}.expert_weights_norm", EXPERT_WEIGHTS_NORM[arch])
    if arch == "llama":
        if norm is not True:
            raise ValueError(f"{f.path}: Mixtral's experts renormalise their weights; the file says {norm!r}")
        cfg.update(architectures=["MixtralForCausalLM"], num_local_experts=experts, num_experts_per_tok=top_k)
        return
    cfg.update(num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=bool(norm))
    if arch == "olmoe":  # its experts' width is feed_forward_length (the converter writes intermediate_size)
        cfg["intermediate_size"] = _size(f, "olmoe.expert_feed_forward_length", cfg["intermediate_size"])
        return
    cfg["moe_intermediate_size"] = _size(f, "qwen3moe.expert_feed_forward_length")
    layers = range(cfg["num_hidden_layers"])
    cfg["mlp_only_layers"] = [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in f.tensors]


def _phi3(f: GGUFFile, cfg: dict[str, Any]) -> None:
    """Phi-3's partial rotary, LongRoPE factors (tensors of their own) and sliding window."""
    rotary = _size(f, "phi3.rope.dimension_count", cfg["head_dim"])
    if rotary > cfg["head_dim"]:
        raise ValueError(f"{f.path}: phi3.rope.dimension_count {rotary} exceeds the head's {cfg['head_dim']} dims")
    rope = cfg["rope_parameters"]
    rope["partial_rotary_factor"] = rotary / cfg["head_dim"]
    if "rope_factors_long.weight" in f.tensors:
        rope.update(rope_type="longrope", long_factor=_float_vector(f, "rope_factors_long.weight", rotary // 2),
                    short_factor=_float_vector(f, "rope_factors_short.weight", rotary // 2))
        cfg["original_max_position_embeddings"] = _size(f, "phi3.rope.scaling.original_context_length")
        factor = f.get("phi3.rope.scaling.attn_factor")
        if factor is not None:
            rope["attention_factor"] = float(_need(f, "phi3.rope.scaling.attn_factor", (int, float)))
    elif rope["rope_type"] != "default":
        raise ValueError(f"{f.path}: Phi-3's rope scaling is LongRoPE's factors, and the file has none")
    window = f.get("phi3.attention.sliding_window", 0)
    if window:  # 0: none (Phi-4's)
        cfg["sliding_window"] = _size(f, "phi3.attention.sliding_window")


def _gemma(f: GGUFFile, arch: str, cfg: dict[str, Any]) -> None:
    """Gemma 2/3: soft caps, sliding layers (their pattern and RoPE base), the attention scale,
    GeGLU; where the file is silent, llama.cpp's assumptions."""
    layers = cfg["num_hidden_layers"]
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    del cfg["hidden_act"]
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if layers == GEMMA_27B_LAYERS[arch] else cfg["head_dim"]
    cfg["query_pre_attn_scalar"] = scalar
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):  # absent: the family's default, as llama.cpp
        if f.get(f"{arch}.{cap}") is not None:
            cfg[cap] = float(_need(f, f"{arch}.{cap}", (int, float)))
    window = f.get(f"{arch}.attention.sliding_window", GEMMA2_WINDOW if arch == "gemma2" else 0)
    pattern = f.get(f"{arch}.attention.sliding_window_pattern", GEMMA_SWA_PATTERN[arch])
    if not window:  # no sliding layers
        cfg["layer_types"] = ["full_attention"] * layers
    elif isinstance(pattern, list):  # a flag per layer
        if len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
            raise ValueError(f"{f.path}: {arch}.attention.sliding_window_pattern is not a flag per layer")
        cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        pattern = _size(f, f"{arch}.attention.sliding_window_pattern", GEMMA_SWA_PATTERN[arch])
        cfg["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if window:
        cfg["sliding_window"] = _size(f, f"{arch}.attention.sliding_window", window)
    if arch == "gemma3":
        local = float(f.get("gemma3.rope.freq_base_swa", GEMMA3_SWA_ROPE_BASE))
        cfg["rope_parameters"] = {"full_attention": cfg["rope_parameters"],
                                  "sliding_attention": {"rope_type": "default", "rope_theta": local}}


def generation_config(f: GGUFFile) -> dict[str, Any]:
    eos = f.get("tokenizer.ggml.eos_token_id")
    eot = f.get("tokenizer.ggml.eot_token_id")
    ids = [i for i in (eos, eot) if isinstance(i, int)]
    return {"eos_token_id": ids} if ids else {}
