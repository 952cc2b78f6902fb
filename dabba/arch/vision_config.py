"""A vision tower's architecture (SigLIP's, as Gemma 3 carries it, or CLIP's, as LLaVA does): what of
its config its code reads, normalised once, from a vision_config mapping (a multimodal
checkpoint's) or a SiglipVisionModel's own config.json."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dabba.arch.qwen_vision_config import QwenVisionConfig

VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "quick_gelu")  # models/siglip.py applies them
VISION_TOWERS = {"siglip_vision_model": "gelu_pytorch_tanh", "clip_vision_model": "quick_gelu"}  # default activations


@dataclass(frozen=True)
class VisionConfig:
    """A ViT over ``patch_size`` squares of an ``image_size`` square image: ``num_patches`` tokens,
    each a learnt position's embedding plus the patch's; pre-norm layers with biases; ``activation``
    one of VISION_ACTIVATIONS. ``clip``: CLIP's tower, a class token before the patches (its own
    position), a LayerNorm before the layers, a patch embedding without bias."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    activation: str
    num_channels: int = 3
    clip: bool = False

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        """Tokens the tower runs on: the patches, and CLIP's class token."""
        return self.num_patches + self.clip

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "vision_config") -> "VisionConfig":
        model_type = cfg.get("model_type", "siglip_vision_model")
        if model_type not in VISION_TOWERS:
            raise ValueError(f"{source}: vision tower {model_type!r} is not supported ({', '.join(VISION_TOWERS)})")
        act = cfg.get("hidden_act", VISION_TOWERS[model_type])
        if act not in VISION_ACTIVATIONS:
            raise ValueError(f"{source}: hidden_act {act!r} is not supported ({', '.join(VISION_ACTIVATIONS)})")
        sizes = {k: cfg.get(k, default) for k, default in (
            ("hidden_size", 768), ("intermediate_size", 3072), ("num_hidden_layers", 12), ("num_attention_heads", 12),
            ("image_size", 224), ("patch_size", 16), ("num_channels", 3))}
        bad = [k for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        if bad:
            raise ValueError(f"{source}: {', '.join(bad)} must be positive integers")
        if sizes["hidden_size"] % sizes["num_attention_heads"]:
            raise ValueError(f"{source}: hidden_size must be a multiple of num_attention_heads")
        if sizes["image_size"] % sizes["patch_size"]:
            raise ValueError(f"{source}: image_size must be a multiple of patch_size")
        return cls(sizes["hidden_size"], sizes["intermediate_size"], sizes["num_hidden_layers"],
                   sizes["num_attention_heads"], sizes["image_size"], sizes["patch_size"],
                   float(cfg.get("layer_norm_eps", 1e-5 if model_type == "clip_vision_model" else 1e-6)), act,
                   sizes["num_channels"], model_type == "clip_vision_model")


@dataclass(frozen=True)
class Gemma3ProjectorConfig:
    """Gemma 3's multimodal projector: the tower's patch grid average-pooled to
    ``tokens_per_image`` tokens (a square grid whose side divides the patches'), Gemma's RMSNorm
    (x * (1 + w)) with the tower's eps, then a linear to the language model's width."""

    tokens_per_image: int
    text_hidden_size: int

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], vision: VisionConfig,
                  source: str = "config.json") -> "Gemma3ProjectorConfig":
        tokens = cfg.get("mm_tokens_per_image", 256)
        text = cfg.get("text_config") or {}
        hidden = text.get("hidden_size")
        side = int(round(tokens ** 0.5)) if isinstance(tokens, int) and tokens > 0 else 0
        patches_side = vision.image_size // vision.patch_size
        if side * side != tokens or patches_side % side:
            raise ValueError(f"{source}: mm_tokens_per_image ({tokens!r}) must be a square whose side divides the "
                             f"{patches_side} patches a side")
        if not isinstance(hidden, int) or hidden < 1:
            raise ValueError(f"{source}: text_config.hidden_size must be a positive integer, got {hidden!r}")
        return cls(tokens, hidden)


@dataclass(frozen=True)
class LlavaProjectorConfig:
    """LLaVA's projector: linear_1 (vision width -> text width), an activation, linear_2, over the
    tower's states after ``num_layers`` layers (vision_feature_layer), CLIP's class token dropped
    ("default") or kept ("full")."""

    text_hidden_size: int
    activation: str  # models/siglip.ACTIVATIONS' names
    bias: bool
    num_layers: int
    drop_class_token: bool

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], vision: VisionConfig, text_hidden_size: int,
                  source: str = "config.json") -> "LlavaProjectorConfig":
        layer = cfg.get("vision_feature_layer", -2)
        if not isinstance(layer, int) or isinstance(layer, bool) or not -vision.num_hidden_layers - 1 <= layer <= \
                vision.num_hidden_layers:
            raise ValueError(f"{source}: vision_feature_layer must be one layer of the tower's "
                             f"{vision.num_hidden_layers} (several are not supported), got {layer!r}")
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"{source}: vision_feature_select_strategy must be default or full, got {strategy!r}")
        act = cfg.get("projector_hidden_act", "gelu")
        if act not in VISION_ACTIVATIONS:
            raise ValueError(f"{source}: projector_hidden_act {act!r} is not supported ({', '.join(VISION_ACTIVATIONS)})")
        return cls(text_hidden_size, act, bool(cfg.get("multimodal_projector_bias", True)),
                   layer if layer >= 0 else vision.num_hidden_layers + 1 + layer,
                   strategy == "default" and vision.clip)


@dataclass(frozen=True)
class ImageInputConfig:
    """How a vision-language model takes an image into its prompt: each image becomes
    ``tokens_per_image`` placeholders (``image_token_id``), whose embeddings the encoder's replace
    (0: as many as the image's size makes, Qwen2.5-VL's). Gemma 3: the prompt marks an image with
    ``image_start_token_id`` (<start_of_image>), which grows into ``around`` + start + placeholders
    + end + ``around``; LLaVA and Qwen2.5-VL: the prompt's image token itself grows into the
    placeholders. ``bidirectional``: an image's tokens attend to each other both ways (Gemma 3),
    not only causally. ``mrope``: the language model turns its rotary by each token's temporal,
    height and width position (Qwen2.5-VL's M-RoPE; layers/rotary.MRotaryEmbedding)."""

    architecture: str  # config.json's (models/registry.py): the model class with the encoder
    vision: VisionConfig | QwenVisionConfig
    projector: Gemma3ProjectorConfig | LlavaProjectorConfig | None  # (Qwen2.5-VL's merger is in its tower)
    image_token_id: int
    tokens_per_image: int
    bidirectional: bool
    image_start_token_id: int | None = None
    image_end_token_id: int | None = None
    around: str = ""
    mrope: bool = False

    @classmethod
    def of(cls, architecture: str, cfg: dict[str, Any], vocab_size: int, text_hidden_size: int) -> "ImageInputConfig":
        if architecture == "Gemma3ForConditionalGeneration":
            return cls.gemma3(cfg, vocab_size)
        if architecture == "LlavaForConditionalGeneration":
            return cls.llava(cfg, vocab_size, text_hidden_size)
        return cls.qwen2_5_vl(cfg, vocab_size, text_hidden_size)

    @classmethod
    def gemma3(cls, cfg: dict[str, Any], vocab_size: int) -> "ImageInputConfig":
        """From a Gemma3ForConditionalGeneration config.json."""
        vision = VisionConfig.from_dict(cfg.get("vision_config") or {})
        projector = Gemma3ProjectorConfig.from_dict(cfg, vision)
        ids = _token_ids(cfg, vocab_size, image_token_index=262_144, boi_token_index=255_999, eoi_token_index=256_000)
        return cls("Gemma3ForConditionalGeneration", vision, projector, ids["image_token_index"],
                   projector.tokens_per_image, True, ids["boi_token_index"], ids["eoi_token_index"], "\n\n")

    @classmethod
    def llava(cls, cfg: dict[str, Any], vocab_size: int, text_hidden_size: int) -> "ImageInputConfig":
        """From a LlavaForConditionalGeneration config.json (a CLIP tower by default, as transformers')."""
        vision = VisionConfig.from_dict({"model_type": "clip_vision_model", **(cfg.get("vision_config") or {})})
        projector = LlavaProjectorConfig.from_dict(cfg, vision, text_hidden_size)
        ids = _token_ids(cfg, vocab_size, image_token_index=32_000)
        return cls("LlavaForConditionalGeneration", vision, projector, ids["image_token_index"],
                   vision.num_positions - projector.drop_class_token, False)

    @classmethod
    def qwen2_5_vl(cls, cfg: dict[str, Any], vocab_size: int, text_hidden_size: int) -> "ImageInputConfig":
        """From a Qwen2_5_VLForConditionalGeneration config.json."""
        vision = QwenVisionConfig.from_dict(cfg.get("vision_config") or {})
        if vision.out_hidden_size != text_hidden_size:
            raise ValueError(f"config.json: vision_config.out_hidden_size ({vision.out_hidden_size}) must be the "
                             f"language model's hidden_size ({text_hidden_size})")
        ids = _token_ids(cfg, vocab_size, image_token_id=151_655)
        return cls("Qwen2_5_VLForConditionalGeneration", vision, None, ids["image_token_id"], 0, False, mrope=True)


def _token_ids(cfg: dict[str, Any], vocab_size: int, **defaults: int) -> dict[str, int]:
    ids = {}
    for key, default in defaults.items():
        value = cfg.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab_size:
            raise ValueError(f"config.json: {key} must be a token id below the vocabulary's {vocab_size}, got "
                             f"{value!r}")
        ids[key] = value
    return ids


# Vision-language checkpoints (their language model's config the text_config, its tensors under
# language_model; ImageInputConfig the rest), with the text config's class defaults that configs
# leave out (the released Gemma 3 4B/12B/27B text_configs name a few sizes only and leave the rest
# to Gemma3TextConfig's defaults; LLaVA's language model is any family, named by its text_config's
# model_type, and a Llama of LlamaConfig's defaults by default; Qwen2.5-VL's is a Qwen2 with M-RoPE,
# its fields at the top level of the released configs)
VISION_LANGUAGE_ARCHITECTURES = {"Gemma3ForConditionalGeneration": {"gemma3_text": "Gemma3ForCausalLM"},
                                 "LlavaForConditionalGeneration": {"llama": "LlamaForCausalLM",
                                                                   "mistral": "MistralForCausalLM",
                                                                   "qwen2": "Qwen2ForCausalLM"},
                                 "Qwen2_5_VLForConditionalGeneration": {"qwen2_5_vl_text": "Qwen2ForCausalLM"}}
VISION_LANGUAGE_TEXT_DEFAULTS = {
    "Gemma3ForConditionalGeneration": dict(model_type="gemma3_text", vocab_size=262_208, hidden_size=2304,
                                           intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                                           num_key_value_heads=4, head_dim=256),
    "LlavaForConditionalGeneration": dict(model_type="llama", vocab_size=32_000, hidden_size=4096,
                                          intermediate_size=11_008, num_hidden_layers=32, num_attention_heads=32,
                                          max_position_embeddings=2048, rms_norm_eps=1e-6),
    "Qwen2_5_VLForConditionalGeneration": dict(model_type="qwen2_5_vl_text", vocab_size=152_064, hidden_size=8192,
                                               intermediate_size=29_568, num_hidden_layers=80, num_attention_heads=64,
                                               num_key_value_heads=8, max_position_embeddings=32_768,
                                               rope_theta=1_000_000.0, rms_norm_eps=1e-5)}
# Qwen2.5-VL's rotary frequencies by temporal, height and width position, where its config says not
QWEN2_5_VL_MROPE_SECTION = [16, 24, 24]


def language_config(architecture: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config.json's language model, as a text model's config.json would say it
    (its ``architectures`` the family's causal LM)."""
    text = cfg.get("text_config")
    qwen = architecture == "Qwen2_5_VLForConditionalGeneration"
    if text is None and qwen:  # the released checkpoints: the language model's fields at the top level
        text = {k: v for k, v in cfg.items() if k not in ("vision_config", "architectures", "model_type")}
    if not isinstance(text, dict):
        raise ValueError(f"{architecture}'s config has no text_config")
    # what the text config leaves to the top level (dtype, token ids), then the language model's own
    inherited = {k: cfg[k] for k in ("dtype", "torch_dtype", "bos_token_id", "eos_token_id", "quantization_config",
                                     *(("tie_word_embeddings",) if qwen else ())) if k in cfg}
    text = {**VISION_LANGUAGE_TEXT_DEFAULTS[architecture], **inherited, **text}
    families = VISION_LANGUAGE_ARCHITECTURES[architecture]
    if text["model_type"] not in families:
        raise ValueError(f"{architecture}: a {text['model_type']!r} language model is not supported "
                         f"({', '.join(families)})")
    if qwen:
        for key in ("rope_parameters", "rope_scaling"):
            if isinstance(text.get(key), dict):
                text[key] = {"mrope_section": QWEN2_5_VL_MROPE_SECTION, **text[key]}
                break
        else:
            text["rope_parameters"] = {"rope_type": "default", "mrope_section": QWEN2_5_VL_MROPE_SECTION}
    return {**text, "architectures": [families[text["model_type"]]]}
