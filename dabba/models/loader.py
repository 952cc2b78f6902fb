"""Build a model from a checkpoint directory, streaming safetensors shards into its parameters.

Safetensors only: a pickled checkpoint (.bin/.pt/.pth) can run arbitrary code when loaded,
so dabba refuses it rather than unpickling it.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from dabba.layers.rotary import describe_longrope
from dabba.models.config import ArchConfig
from dabba.models.registry import get_model_class
from dabba.quantization.config import QuantConfig

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

logger = logging.getLogger("dabba")


def find_weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names shards that are not there: {missing}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(model_dir.glob("model-*.safetensors"))
    if shards:
        return shards
    pickled = [p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickled:
        raise ValueError(
            f"{model_dir} holds only pickled weights ({', '.join(pickled)}); dabba never unpickles a checkpoint. "
            "Convert it to safetensors (for example with transformers: model.save_pretrained(dir, safe_serialization=True))."
        )
    raise ValueError(f"{model_dir} has no model.safetensors or model-*.safetensors shards")


def iterate_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(model_dir: str | Path, arch: ArchConfig, dtype: torch.dtype, device: torch.device, max_position: int,
               quant_config: QuantConfig | None = None) -> nn.Module:
    model_dir = Path(model_dir)
    files = find_weight_files(model_dir)
    model_cls = get_model_class(arch.architecture)
    if arch.rope_scaling.rope_type == "longrope":
        logger.info(describe_longrope(arch.rope_scaling, max_position))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(arch, max_position, quant_config)
    finally:
        torch.set_default_dtype(previous)
    model.load_weights(iterate_weights(files))
    for module in model.modules():  # repack (or quantize) once, never per forward
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return model.eval()
