"""Normalise a Hugging Face config.json once, so model code never guesses defaults."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dabba.arch.encoder_config import ENCODER_ARCHITECTURES, EncoderConfig, encoder_config
from dabba.arch.files import read_json_object
from dabba.arch.rope_scaling import LAYER_TYPES, RopeScaling, rope_parameters, rope_scaling
from dabba.arch.vision_config import VISION_LANGUAGE_ARCHITECTURES, ImageInputConfig, language_config

SUPPORTED_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
                           "MixtralForCausalLM", "OlmoeForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
QWEN_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "OlmoeForCausalLM", "Qwen3MoeForCausalLM")
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
GEMMA_MAX_POSITIONS = {"Gemma2ForCausalLM": 8192, "Gemma3ForCausalLM": 131_072}  # their configs' defaults
# A family's base model (transformers' *Model: no LM head, tensors without the "model." prefix), as
# embedding checkpoints save it: served as a pooler (runner "pooling"), never as a generator.
BASE_MODEL_ARCHITECTURES = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
                            "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM",
                            "Gemma2Model": "Gemma2ForCausalLM", "Gemma3TextModel": "Gemma3ForCausalLM"}
# A family's sequence classifier (transformers' *ForSequenceClassification: the base model and a
# ``score`` head over the last token), as decoder rerankers save it (Qwen3-Reranker's seq-cls form).
SEQUENCE_CLASSIFIER_ARCHITECTURES = {"LlamaForSequenceClassification": "LlamaForCausalLM",
                                     "MistralForSequenceClassification": "MistralForCausalLM",
                                     "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
                                     "Qwen3ForSequenceClassification": "Qwen3ForCausalLM"}
# Architectures dabba knows and refuses, with what to use instead.
REFUSED_ARCHITECTURES: dict[str, str] = {}
# The gated MLP's activation, by config value: SwiGLU (Llama's "silu") or GeGLU with gelu's tanh
# approximation (Gemma's "gelu_pytorch_tanh"). dabba.ops.activation.act_and_mul computes them.
MLP_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP's shape and routing (dabba.layers.fused_moe)."""
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k weights divided by their sum (Mixtral always; the others per norm_topk_prob)
    # the routing weights rounded to the model's dtype before they scale the experts' outputs
    # (Qwen3-MoE, OLMoE), or kept in float32 (Mixtral), as transformers does
    weights_in_model_dtype: bool
    # which layers route (Qwen3-MoE's mlp_only_layers and decoder_sparse_step); the rest run a
    # dense MLP of the config's intermediate_size
    sparse_layers: tuple[bool, ...]


SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings")


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
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3; Gemma 3, Gemma's (1 + w) form)
    sliding_window: int | None
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    quantization_config: dict | None = None  # a pre-quantized checkpoint's (GPTQ, AWQ, compressed-tensors)
    # RoPE rotates the first rotary_dim dims of each head (head_dim * partial_rotary_factor,
    # Phi-4-mini: 0.75); the rest pass through. None: the whole head.
    rotary_dim: int | None = None
    # Which layers attend within sliding_window, one flag per layer; None: every layer (Mistral,
    # Phi-3). Qwen2/3 and Gemma: their layer_types, by default (Qwen) the layers from
    # max_window_layers on, (Gemma 2) every other layer from 0, (Gemma 3) all but every
    # sliding_window_pattern-th.
    sliding_layers: tuple[bool, ...] | None = None
    # act(gate) * up in every MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma's gelu_pytorch_tanh).
    mlp_activation: str = "silu"
    # Gemma: attention scores are scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # Gemma 2's tanh soft caps, x -> cap * tanh(x / cap): on every layer's attention scores (after
    # the scale, before the mask and softmax) and on the final logits. None: no cap.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 3: the sliding layers' RoPE base (default rope, unscaled); rope_theta and rope_scaling
    # are then the global layers'. None: every layer uses rope_theta and rope_scaling.
    rope_local_theta: float | None = None
    # Mixture-of-experts families (Mixtral, Qwen3-MoE, OLMoE); None: a dense MLP in every layer.
    moe: MoEConfig | None = None
    # OLMoE normalises q and k over the whole projection (all heads at once), not per head
    qk_norm_whole: bool = False
    # config.json names the family's base model (BASE_MODEL_ARCHITECTURES): no LM head to generate with
    base_model: bool = False
    # a BERT-style bidirectional encoder (arch/encoder_config.py): it pools or classifies, never generates
    encoder: EncoderConfig | None = None
    # a decoder sequence classifier (SEQUENCE_CLASSIFIER_ARCHITECTURES): its score head's outputs
    num_labels: int = 0
    # vLLM's classifier_from_token: a causal LM served as a classifier, its score head made from the
    # LM head's rows for these tokens (one: that token's logit; two, [a, b]: b's logit minus a's,
    # whose sigmoid is b's probability in the two-way softmax). The ids: the tokenizer's, filled in
    # when the config is resolved (models/resolved_config.py)
    classifier_from_token: tuple[str, ...] = ()
    classifier_token_ids: tuple[int, ...] = ()
    # Qwen3-Reranker as released: pairs are read in its judging prompt (entrypoints/scoring.py)
    original_qwen3_reranker: bool = False
    # a vision-language checkpoint (VISION_LANGUAGE_ARCHITECTURES): how images enter its prompt. The
    # rest of this config is its language model's (the text_config), whose tensors sit under
    # language_model (models/loader.py renames them)
    images: ImageInputConfig | None = None

    @property
    def vision_language(self) -> bool:
        return self.images is not None

    @property
    def attn_scale(self) -> float:
        """What q . k is multiplied by before the softmax (and the soft cap)."""
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """Layer ``layer_idx``'s attention window in keys (a query sees itself and the window - 1
        keys before it), or None where it attends the whole context."""
        if self.sliding_window is None or (self.sliding_layers is not None and not self.sliding_layers[layer_idx]):
            return None
        return self.sliding_window

    @classmethod
    def from_hf(cls, model_dir: str | Path, overrides: dict[str, Any] | None = None) -> "ArchConfig":
        """``overrides``: fields laid over config.json's (the hf_overrides option)."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no config.json: is it a Hugging Face model directory?")
        cfg = {**read_json_object(path), **(overrides or {})}
        named = cfg.get("architectures")
        if named is not None and not (isinstance(named, list) and all(isinstance(a, str) for a in named)):
            raise ValueError(f"{path}{' with hf_overrides' if overrides else ''}: architectures must be a list of "
                             f"names, got {named!r}")
        try:
            arch = cls.from_dict(cfg)
        except KeyError as e:
            raise ValueError(f"{path} has no {e.args[0]!r}, which {cfg.get('architectures') or 'the model'} needs") from None
        except (TypeError, AttributeError) as e:  # a field of the wrong kind: a string where a number goes
            raise ValueError(f"{path} has a field of the wrong type ({e})") from None
        for name in SIZE_FIELDS:  # what would otherwise fail deep in the model's construction
            value = getattr(arch, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{path} has a field of the wrong type: {name} must be a positive integer, not {value!r}")
        return arch

    @classmethod
    def _encoder(cls, arch: str, cfg: dict[str, Any]) -> "ArchConfig":
        """A BERT-style encoder: the decoder fields it shares (sizes, biases everywhere), no RoPE,
        its positions those its position table holds past RoBERTa's offset."""
        encoder = encoder_config(arch, cfg)
        num_heads = cfg["num_attention_heads"]
        bias = bool(cfg.get("attention_bias", False)) if encoder.family == "modernbert" else True
        return cls(
            architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads, num_key_value_heads=num_heads, head_dim=cfg["hidden_size"] // num_heads,
            rms_norm_eps=encoder.layer_norm_eps, rope_theta=0.0, rope_scaling=RopeScaling(),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192 if encoder.family == "modernbert" else 512)
            - encoder.position_offset,
            tie_word_embeddings=False, qkv_bias=bias, o_bias=bias, qk_norm=False, sliding_window=None,
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"), bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=(), base_model=encoder.classifier is None, encoder=encoder)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ArchConfig":
        named = cfg.get("architectures") or []
        vision_language = next((a for a in named if a in VISION_LANGUAGE_ARCHITECTURES), None)
        if vision_language is not None:
            arch = cls.from_dict(language_config(vision_language, cfg))
            images = ImageInputConfig.of(vision_language, cfg, arch.vocab_size, arch.hidden_size)
            return dataclasses.replace(arch, images=images)
        encoder = next((a for a in named if a in ENCODER_ARCHITECTURES), None)
        if encoder is not None:
            return cls._encoder(encoder, cfg)
        bases = {**BASE_MODEL_ARCHITECTURES, **SEQUENCE_CLASSIFIER_ARCHITECTURES}
        archs = [bases.get(a, a) if isinstance(a, str) else a for a in named]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        base_model = arch is not None and named[archs.index(arch)] != arch
        classifier = arch is not None and named[archs.index(arch)] in SEQUENCE_CLASSIFIER_ARCHITECTURES
        num_labels = (cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 1) if classifier else 0
        refused = next((a for a in archs if a in REFUSED_ARCHITECTURES), None)
        if arch is None and refused is not None:
            raise ValueError(f"unsupported architecture {refused!r}: {REFUSED_ARCHITECTURES[refused]}")
        if arch is None:
            remote = " (its config asks for remote code via auto_map, which dabba never runs)" if "auto_map" in cfg else ""
            raise ValueError(
                f"unsupported architecture {named or cfg.get('model_type')!r}{remote}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        from_token = _classifier_from_token(cfg, classifier)
        if from_token:
            num_labels = 1
        gemma = arch in GEMMA_ARCHITECTURES
        # transformers' Gemma 2/3 read hidden_activation (their configs may carry a stale hidden_act too)
        act_field = "hidden_activation" if gemma else "hidden_act"
        act = cfg.get(act_field) or ("gelu_pytorch_tanh" if gemma else "silu")
        if act not in MLP_ACTIVATIONS:
            raise ValueError(f"unsupported {act_field} {act!r}: supported {sorted(MLP_ACTIVATIONS)} "
                             "('silu': SwiGLU, 'gelu_pytorch_tanh': GeGLU)")
        if gemma and cfg.get("use_bidirectional_attention"):
            raise ValueError("unsupported config: use_bidirectional_attention=true (dabba attends causally)")
        if cfg.get("mlp_bias"):
            raise ValueError("unsupported config: mlp_bias=true")
        quantization = cfg.get("quantization_config")  # "gguf": a GGUF file's tensor types
        if quantization and quantization.get("quant_method") not in ("gptq", "awq", "gguf", "compressed-tensors"):
            raise ValueError(f"unsupported quantization_config {quantization.get('quant_method')!r} "
                             "(supported: 'gptq', 'awq', 'compressed-tensors')")

        num_heads = cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})")
        head_dim = cfg.get("head_dim") or (256 if gemma else cfg["hidden_size"] // num_heads)

        layer_types = _layer_types(arch, cfg)
        rope, local_rope = rope_parameters(arch, cfg, layer_types)
        rope_theta = float(rope["rope_theta"])
        max_position_embeddings = cfg.get("max_position_embeddings", GEMMA_MAX_POSITIONS.get(arch, 2048))
        scaling, rotary_dim = rope_scaling(arch, cfg, rope, head_dim, max_position_embeddings)

        # Mistral and Phi3 attend within it whenever it is set (transformers masks with it), in every
        # layer; Qwen only with use_sliding_window, and Qwen and Gemma only in the layers their
        # layer_types name (_layer_types; Gemma's window is 4096 unless the config says otherwise)
        sliding_window = cfg.get("sliding_window", 4096 if gemma else None)
        sliding_layers = None if layer_types is None else tuple(t == "sliding_attention" for t in layer_types)
        if arch in QWEN_ARCHITECTURES and not cfg.get("use_sliding_window", False):
            sliding_window = None
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or null, not {sliding_window}")
        # transformers' Gemma2Config defaults the caps to 50 and 30; Gemma 3 has none, and its attention
        # never applies attn_logit_softcapping, whatever the config says (only the final cap).
        caps: dict[str, float | None] = {"attn_logit_softcapping": None, "final_logit_softcapping": None}
        for key, gemma2_default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
            cap = cfg.get(key, gemma2_default if arch == "Gemma2ForCausalLM" else None) if gemma else None
            if cap is not None and not (isinstance(cap, (int, float)) and cap > 0):
                raise ValueError(f"{key} must be a number > 0 or null, not {cap!r}")
            caps[key] = None if cap is None else float(cap)
        if arch == "Gemma3ForCausalLM":
            caps["attn_logit_softcapping"] = None
        query_pre_attn_scalar = cfg.get("query_pre_attn_scalar", 256) if gemma else None
        if gemma and not (isinstance(query_pre_attn_scalar, (int, float)) and query_pre_attn_scalar > 0):
            raise ValueError(f"query_pre_attn_scalar must be a number > 0, not {query_pre_attn_scalar!r}")

        if arch == "OlmoeForCausalLM" and cfg.get("clip_qkv") is not None:
            raise ValueError(f"unsupported config: clip_qkv={cfg['clip_qkv']!r} (OLMoE with clipped q/k/v)")
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
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            o_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "OlmoeForCausalLM"),
            qk_norm_whole=arch == "OlmoeForCausalLM",
            moe=_moe_config(arch, cfg),
            sliding_window=sliding_window,
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            quantization_config=quantization or None,
            rotary_dim=rotary_dim,
            sliding_layers=sliding_layers,
            mlp_activation=MLP_ACTIVATIONS[act],
            query_pre_attn_scalar=None if query_pre_attn_scalar is None else float(query_pre_attn_scalar),
            rope_local_theta=None if local_rope is None else float(local_rope["rope_theta"]),
            base_model=base_model,
            num_labels=num_labels,
            classifier_from_token=from_token,
            original_qwen3_reranker=bool(cfg.get("is_original_qwen3_reranker")),
            **caps,
        )


def _classifier_from_token(cfg: dict[str, Any], classifier: bool) -> tuple[str, ...]:
    """vLLM's spelling: ``classifier_from_token`` names the tokens; ``is_original_qwen3_reranker``
    alone means Qwen3-Reranker's ["no", "yes"]."""
    tokens = cfg.get("classifier_from_token")
    if tokens is None and cfg.get("is_original_qwen3_reranker"):
        tokens = ["no", "yes"]
    if tokens is None:
        return ()
    if not (isinstance(tokens, list) and all(isinstance(t, str) for t in tokens) and len(tokens) in (1, 2)):
        raise ValueError(f"classifier_from_token must list one or two tokens, got {tokens!r}")
    if not classifier:
        raise ValueError("classifier_from_token makes a sequence classifier of a causal LM: the architectures must "
                         f"name one ({', '.join(SEQUENCE_CLASSIFIER_ARCHITECTURES)})")
    if cfg.get("final_logit_softcapping"):
        raise ValueError("classifier_from_token needs the LM head's logits linear (no final_logit_softcapping)")
    return tuple(tokens)


def _layer_types(arch: str, cfg: dict[str, Any]) -> list[str] | None:
    """Each layer's attention kind, as transformers' configs derive it; None where every layer
    attends alike (Mistral and Phi-3 slide in every layer when sliding_window is set)."""
    num_layers = cfg["num_hidden_layers"]
    if arch == "Gemma2ForCausalLM":  # alternate, layer 0 sliding
        default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    elif arch == "Gemma3ForCausalLM":  # every sliding_window_pattern-th layer global (Gemma 3: 6)
        pattern = cfg.get("sliding_window_pattern") or 6
        default = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    elif arch in QWEN_ARCHITECTURES:  # the layers from max_window_layers on
        default = ["sliding_attention" if i >= cfg.get("max_window_layers", 28) else "full_attention"
                   for i in range(num_layers)]
    else:
        return None
    layer_types = cfg.get("layer_types") or default
    if len(layer_types) != num_layers or any(t not in LAYER_TYPES for t in layer_types):
        raise ValueError(f"layer_types must list one of {LAYER_TYPES} per layer ({num_layers}), got {layer_types!r}")
    return list(layer_types)


def _moe_config(arch: str, cfg: dict[str, Any]) -> MoEConfig | None:
    """The routing of a mixture-of-experts family, read as its transformers config reads it."""
    if arch not in MOE_ARCHITECTURES:
        return None
    num_layers = cfg["num_hidden_layers"]
    num_experts = cfg.get("num_local_experts") if arch == "MixtralForCausalLM" else None
    num_experts = num_experts or cfg.get("num_experts") or cfg.get("num_local_experts")
    top_k = cfg.get("num_experts_per_tok")
    inter = cfg.get("moe_intermediate_size") if arch == "Qwen3MoeForCausalLM" else cfg.get("intermediate_size")
    for name, value in (("num_experts", num_experts), ("num_experts_per_tok", top_k), ("expert intermediate size", inter)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{arch} needs a positive integer {name}, got {value!r}")
    if top_k > num_experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must not exceed the number of experts ({num_experts})")
    sparse = [True] * num_layers
    if arch == "Qwen3MoeForCausalLM":
        only_dense = set(cfg.get("mlp_only_layers") or [])
        step = cfg.get("decoder_sparse_step") or 1
        sparse = [i not in only_dense and (i + 1) % step == 0 for i in range(num_layers)]
    return MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=inter,
                     renormalize=True if arch == "MixtralForCausalLM" else bool(cfg.get("norm_topk_prob", False)),
                     weights_in_model_dtype=arch != "MixtralForCausalLM", sparse_layers=tuple(sparse))
