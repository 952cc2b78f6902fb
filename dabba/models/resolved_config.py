"""The one resolved configuration: an EngineConfig with everything that depends on the checkpoint
and the machine settled once (where the files are, the architecture, dtype, device, context
length, quantization, the draft model's own). The engine, every worker rank, the planner,
evaluation and the draft model read this object; nothing resolves a setting a second time.

It sits on the models rung: it locates checkpoints (hub.py) and picks each one's linear method."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dabba.arch.config import ArchConfig
from dabba.arch.files import read_json_object
from dabba.arch.pooling_config import (CROSS_ENCODER, DECODER_SCORER, QWEN3_RERANKER, PoolerConfig,
                                      is_sentence_transformer, read_pooler_config)
from dabba.config import EngineConfig
from dabba.models.hub import MODEL_FILES, TOKENIZER_FILES, resolve_model_dir
from dabba.quantization.config import QUANTIZATION_METHODS, QuantConfig

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, checkpoint_dtype: str | None) -> torch.dtype:
    if dtype == "auto":
        return _DTYPES.get(checkpoint_dtype or "float32", torch.float32)
    return _DTYPES[dtype]


def resolve_max_model_len(requested: int | None, arch: ArchConfig) -> int:
    limit = arch.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's limit of {limit} tokens")
    return requested


def load_generation_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "generation_config.json"
    return read_json_object(path) if path.is_file() else {}


def checkpoint_quant_config(arch: ArchConfig, requested: str | None) -> QuantConfig | None:
    """A quantized checkpoint's own method (GPTQ, AWQ), else the load-time rounding asked for."""
    if arch.quantization_config and requested:
        raise ValueError(f"quantization={requested!r}: this checkpoint is already quantized "
                         f"({arch.quantization_config.get('quant_method')})")
    if arch.quantization_config:
        return QuantConfig.from_checkpoint(arch.quantization_config)
    return QuantConfig(requested) if requested else None


def resolve_runner(requested: str, arch: ArchConfig, model_dir: Path) -> str:
    """"pooling" for a checkpoint that is a pooler (a base model, sentence-transformers files),
    else "generate"; a base model has no LM head to generate with."""
    if arch.encoder is not None:
        if requested == "generate":
            raise ValueError(f"runner='generate': {arch.architecture} is an encoder; it can only pool or score")
        return "pooling"
    if requested == "generate" and arch.base_model:
        raise ValueError(f"runner='generate': {model_dir} holds a base model without an LM head; it can only "
                         "pool (runner 'pooling' or 'auto')")
    if requested != "auto":
        return requested
    return "pooling" if arch.base_model or is_sentence_transformer(model_dir) else "generate"


def classifier_token_ids(tokenizer_dir: Path, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """The vocabulary ids of classifier_from_token's tokens (as written in tokenizer.json's
    vocabulary or its added tokens: "yes", not the text that encodes to it)."""
    from tokenizers import Tokenizer

    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"classifier_from_token needs the tokenizer's vocabulary: {tokenizer_dir} has no "
                         "tokenizer.json")
    tokenizer = Tokenizer.from_file(str(path))
    ids = tuple(tokenizer.token_to_id(t) for t in tokens)
    missing = [t for t, i in zip(tokens, ids) if i is None]
    if missing:
        raise ValueError(f"classifier_from_token: {missing} not in the tokenizer's vocabulary")
    return ids  # type: ignore[return-value]


@dataclass(frozen=True)
class ResolvedDraft:
    """A draft model's checkpoint, resolved as the target's is (speculative decoding)."""

    model_dir: str
    arch: ArchConfig
    quant_config: QuantConfig | None  # its own quantization, else the load-time rounding the target asked for


@dataclass(frozen=True)
class ResolvedConfig:
    """Picklable: a worker process or a Ray actor gets a copy and builds its rank from it."""

    config: EngineConfig  # as the user gave it (options that need no resolving are read there)
    model_dir: str
    tokenizer_dir: str
    arch: ArchConfig
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    quant_config: QuantConfig | None
    draft: ResolvedDraft | None = None
    runner: str = "generate"  # "pooling": the model is built without its LM head
    pooler_config: PoolerConfig | None = None  # how its embeddings pool (a generator embeds too)


def resolve_config(config: EngineConfig, model_files: list[str] = MODEL_FILES) -> ResolvedConfig:
    """Settle ``config`` against its checkpoint (downloading ``model_files`` of a Hub repo id
    first: the planner asks for the config files alone) and this machine; ValueError naming the
    field when it cannot be."""
    mc = config.model_config
    model_dir = resolve_model_dir(mc.model, mc.revision, mc.download_dir, model_files, gguf_file=mc.gguf_file)
    tokenizer_dir = (model_dir if mc.tokenizer is None else
                     resolve_model_dir(mc.tokenizer, None, mc.download_dir, TOKENIZER_FILES, field="tokenizer"))
    arch = ArchConfig.from_hf(model_dir, mc.hf_overrides)
    if arch.classifier_from_token:
        arch = replace(arch, classifier_token_ids=classifier_token_ids(Path(tokenizer_dir), arch.classifier_from_token))
    quant_config = checkpoint_quant_config(arch, mc.quantization)
    spec = config.scheduler_config.speculative_config
    draft = None
    if spec is not None and spec.model is not None:  # a draft model given as a Hub id is fetched like the target
        draft_dir = resolve_model_dir(spec.model, None, mc.download_dir)
        draft_arch = ArchConfig.from_hf(draft_dir)
        own = QuantConfig.from_checkpoint(draft_arch.quantization_config) if draft_arch.quantization_config else None
        rounding = quant_config if quant_config is not None and quant_config.method in QUANTIZATION_METHODS else None
        draft = ResolvedDraft(str(draft_dir), draft_arch, own or rounding)
    runner = resolve_runner(mc.runner, arch, model_dir)
    if arch.encoder is not None and arch.encoder.classifier is not None:
        if arch.encoder.num_labels != 1:
            raise ValueError(f"{model_dir}: a sequence classifier with {arch.encoder.num_labels} labels; dabba serves "
                             "cross-encoders that score a text pair with one logit")
        pooler = CROSS_ENCODER if arch.encoder.classifier_pooling == "cls" else replace(
            CROSS_ENCODER, pooling_type="MEAN", source="a sequence classifier (the mean of its tokens)")
    elif arch.num_labels:
        if arch.num_labels != 1:
            raise ValueError(f"{model_dir}: a sequence classifier with {arch.num_labels} labels; dabba serves "
                             "rerankers that score a text pair with one logit")
        pooler = QWEN3_RERANKER if arch.original_qwen3_reranker else DECODER_SCORER
    else:
        hf_config = {**read_json_object(model_dir / "config.json"), **(mc.hf_overrides or {})}
        pooler = read_pooler_config(model_dir, hf_config, mc.pooling_type, "LAST" if arch.encoder is None else "CLS")
    return ResolvedConfig(config, str(model_dir), str(tokenizer_dir), arch, resolve_dtype(mc.dtype, arch.torch_dtype),
                          resolve_device(mc.device), resolve_max_model_len(mc.max_model_len, arch), quant_config, draft,
                          runner, pooler)
