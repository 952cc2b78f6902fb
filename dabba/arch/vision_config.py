"""A vision tower's architecture (SigLIP's, as Gemma 3 carries it, or CLIP's, as LLaVA does): what of
its config its code reads, normalised once, from a vision_config mapping (a multimodal
checkpoint's) or a SiglipVisionModel's own config.json."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    ``tokens_per_image`` placeholders (``image_token_id``), whose embeddings the encoder's replace.
    Gemma 3: the prompt marks an image with ``image_start_token_id`` (<start_of_image>), which grows
    into ``around`` + start + placeholders + end + ``around``; LLaVA: the prompt's image token
    itself grows into the placeholders. ``bidirectional``: an image's tokens attend to each other
    both ways (Gemma 3), not only causally (LLaVA)."""

    architecture: str  # config.json's (models/registry.py): the model class with the encoder
    vision: VisionConfig
    projector: Gemma3ProjectorConfig | LlavaProjectorConfig
    image_token_id: int
    tokens_per_image: int
    bidirectional: bool
    image_start_token_id: int | None = None
    image_end_token_id: int | None = None
    around: str = ""

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


def _token_ids(cfg: dict[str, Any], vocab_size: int, **defaults: int) -> dict[str, int]:
    ids = {}
    for key, default in defaults.items():
        value = cfg.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab_size:
            raise ValueError(f"config.json: {key} must be a token id below the vocabulary's {vocab_size}, got "
                             f"{value!r}")
        ids[key] = value
    return ids
