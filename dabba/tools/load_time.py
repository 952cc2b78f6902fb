"""How long loading a model takes on this machine, predicted without loading it (`dabba plan
--load-time`): what a load does, each at a rate measured here and now on the real code.

    seconds = fixed + checkpoint bytes / read rate + weight bytes / processing rate + KV bytes / zeroing rate

- read: the checkpoint's files, a sample of them read in 16 MiB pieces spread over each file
  (the disk, or the page cache where they already sit);
- processing: one of the model's widest projections (intermediate x hidden) through its linear
  method (dtype conversion, repacking or quantizing), as the loader runs it, per byte of the
  checkpoint's weights;
- zeroing: the KV cache is zeroed up front (its pages made resident);
- fixed: the native kernels' load (a cached build) and the tokenizer's.
A server of several models (engine/model_router.py) reports what each load actually took.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from dabba.arch.config import ArchConfig
from dabba.layers.linear import Linear
from dabba.quantization.config import QuantConfig

PIECE = 16 * 2**20


def checkpoint_files(model_dir: Path, gguf_file: str | None = None) -> list[Path]:
    if gguf_file is not None:
        return [model_dir / gguf_file]
    return sorted(model_dir.glob("*.safetensors"))


def read_rate(files: list[Path], sample_bytes: int = 256 * 2**20) -> float:
    """Bytes/s reading ``files``: pieces spread evenly over each (a share of the sample by size)."""
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    if total == 0:
        return float("inf")
    read, start = 0, time.perf_counter()
    for path, size in zip(files, sizes):
        pieces = max(1, round(min(sample_bytes, total) * size / total / PIECE))
        with open(path, "rb", buffering=0) as f:
            for i in range(pieces):
                f.seek(min(size - 1, i * size // pieces))
                read += len(f.read(min(PIECE, size)))
    return read / max(time.perf_counter() - start, 1e-9)


def process_rate(arch: ArchConfig, dtype: torch.dtype, quant_config: QuantConfig | None) -> float:
    """Checkpoint bytes/s through the model's linear method: one projection of its widest MLP
    shape, loaded and processed as the loader does it; the slowest of 3, as a plan of memory and
    time should err long, not short."""
    intermediate = arch.intermediate_size or 4 * arch.hidden_size
    weight = torch.randn(intermediate, arch.hidden_size).to(dtype)
    slowest = 0.0
    for _ in range(3):
        layer = Linear(arch.hidden_size, [intermediate], quant_config=quant_config, prefix="load_time")
        if quant_config is not None and not hasattr(layer, "weight"):  # a checkpoint format's packed tensors
            return float("inf")  # read as they are stored: the read rate covers them
        start = time.perf_counter()
        layer.weight_loader(layer.weight, weight)
        layer.quant_method.process_weights_after_loading(layer)
        slowest = max(slowest, time.perf_counter() - start)
    return weight.numel() * weight.element_size() / max(slowest, 1e-9)


def zero_rate(nbytes: int = 64 * 2**20) -> float:
    start = time.perf_counter()
    buffer = torch.zeros(nbytes // 2, dtype=torch.bfloat16)
    buffer.add_(0)  # touched, as a first step touches the cache
    return nbytes / max(time.perf_counter() - start, 1e-9)


def fixed_seconds(tokenizer_dir: str) -> float:
    from dabba.engine.tokenizer import Tokenizer
    from dabba.ops import native

    start = time.perf_counter()
    native.load_cpu_ops()
    Tokenizer(tokenizer_dir)
    return time.perf_counter() - start


def predict_load_time(model_dir: str, tokenizer_dir: str, arch: ArchConfig, dtype: torch.dtype,
                      quant_config: QuantConfig | None, kv_cache_bytes: int, gguf_file: str | None = None,
                      rates: dict | None = None) -> float:
    """Seconds; ``rates``, if given, caches the measurements shared between rows of one plan."""
    rates = {} if rates is None else rates
    files = checkpoint_files(Path(model_dir), gguf_file)
    checkpoint_bytes = sum(os.path.getsize(f) for f in files)
    if "read" not in rates:
        rates["fixed"], rates["read"], rates["zero"] = fixed_seconds(tokenizer_dir), read_rate(files), zero_rate()
    key = ("process", quant_config.method if quant_config else None)
    if key not in rates:
        rates[key] = process_rate(arch, dtype, quant_config)
    return (rates["fixed"] + checkpoint_bytes / rates["read"] + checkpoint_bytes / rates[key]
            + kv_cache_bytes / rates["zero"])
