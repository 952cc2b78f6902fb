"""Architecture name (config.json "architectures") -> model class."""
from __future__ import annotations

from typing import Callable

from torch import nn

from dabba.arch.config import ArchConfig
from dabba.models.bert import BertModel
from dabba.models.gemma import GemmaForCausalLM
from dabba.models.gemma3_mm import Gemma3ForConditionalGeneration
from dabba.models.llava import llava_for
from dabba.models.llama import LlamaForCausalLM
from dabba.models.modernbert import ModernBertModel
from dabba.models.moe import MoEForCausalLM, OlmoeForCausalLM, Qwen3MoeForCausalLM
from dabba.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from dabba.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    # BERT-style encoders (arch/encoder_config.py), bare or with a sequence classifier
    "BertModel": BertModel,
    "BertForSequenceClassification": BertModel,
    "RobertaModel": BertModel,
    "RobertaForSequenceClassification": BertModel,
    "XLMRobertaModel": BertModel,
    "XLMRobertaForSequenceClassification": BertModel,
    "ModernBertModel": ModernBertModel,
    "ModernBertForSequenceClassification": ModernBertModel,
    "Gemma2ForCausalLM": GemmaForCausalLM,  # Gemma 2 and 3 differ only in ArchConfig fields
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MoEForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,  # fused qkv/gate_up tensors, partial rotary, longrope: ArchConfig
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(MODEL_REGISTRY)}") from None


# Vision-language architectures: config.json's name -> the model class over its language model's
VISION_LANGUAGE_MODELS: dict[str, Callable[[type[nn.Module]], type[nn.Module]]] = {
    "Gemma3ForConditionalGeneration": lambda language: Gemma3ForConditionalGeneration,
    "LlavaForConditionalGeneration": llava_for,
    "Qwen2_5_VLForConditionalGeneration": lambda language: Qwen2_5_VLForConditionalGeneration,
}


def get_vision_language_class(architecture: str, language_cls: type[nn.Module]) -> type[nn.Module]:
    return VISION_LANGUAGE_MODELS[architecture](language_cls)


def model_class_for(arch: ArchConfig) -> type[nn.Module]:
    """The class a config's model is built from: its family's, with the vision encoder where it reads images."""
    model_cls = get_model_class(arch.architecture)
    if arch.images is not None:
        model_cls = get_vision_language_class(arch.images.architecture, model_cls)
    return model_cls
