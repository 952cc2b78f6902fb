"""Build a model from a checkpoint directory, streaming safetensors shards into its parameters
and repacking (or quantizing) each layer as soon as its last tensor is in.

Safetensors only: a pickled checkpoint (.bin/.pt/.pth) can run arbitrary code when loaded,
so dabba refuses it rather than unpickling it.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
from pathlib import Path
from typing import Any, Generator, Hashable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from dabba.arch.config import ArchConfig
from dabba.arch.files import read_json_object
from dabba.distributed.tensor_parallel import SINGLE, TensorParallel, building_for
from dabba.layers.embedding import LMHead
from dabba.layers.rotary import describe_longrope
from dabba.models.gguf_checkpoint import GGUF_LINK, iterate_gguf_weights
from dabba.models.pooling import pooling_variant
from dabba.models.registry import model_class_for
from dabba.quantization.base import UnquantizedLinearMethod
from dabba.quantization.config import QuantConfig
from dabba.quantization.w8a8_modules import w8a8_linears

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

logger = logging.getLogger("dabba")


def find_weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index} has no weight_map of tensor names to file names")
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


MAPPED_BYTES = 64 * 2**20  # read from one opening of a safetensors file before it is reopened


@contextlib.contextmanager
def open_safetensors(file: Path) -> Iterator[Any]:
    """safe_open, with a truncated or corrupt file (its header, or data shorter than the header
    says) a ValueError naming it: the usual cause is an interrupted download."""
    try:
        handle = safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file} is not a readable safetensors file ({e}); if it was downloaded, the download may be "
                         "incomplete: delete it and fetch it again") from None
    with handle as f:
        yield f


def iterate_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every file, each a view of the file's memory map. Every page read stays
    resident (and counts in the process's RSS and PSS) while its map is open, so one open 3 GB
    file doubled a bf16 load's peak: the file is reopened after each MAPPED_BYTES read, and a
    closed map's pages go as soon as the consumer drops its tensors."""
    for file in files:
        with open_safetensors(file) as f:
            names = list(f.keys())
        while names:
            names = yield from _read_window(file, names)


def _read_window(file: Path, names: list[str]) -> Generator[tuple[str, torch.Tensor], None, list[str]]:
    """The first of ``names`` from one opening of ``file``, up to MAPPED_BYTES (at least one
    tensor); returns the names still to read."""
    mapped = 0
    with open_safetensors(file) as f:
        for i, name in enumerate(names):
            if mapped >= MAPPED_BYTES:
                return names[i:]
            tensor = f.get_tensor(name)
            mapped += tensor.nbytes
            yield name, tensor
            del tensor  # the map closes with the consumer's last reference, not this frame's
    return []


class LayerwiseRepacking:
    """Runs each quantized layer's ``process_weights_after_loading`` as soon as the checkpoint has
    filled all of its parameters (every shard of a merged one), so the full-precision weight it
    replaces is freed before later layers' tensors are read: a load-time INT8/INT4 load never
    holds the whole bf16 model beside the quantized one. Holds names and modules, never the
    parameters themselves (that would keep them alive)."""

    def __init__(self, model: nn.Module) -> None:
        self.waiting: dict[nn.Module, dict[str, set[Hashable]]] = {}  # layer -> parameter -> shards not yet in
        owners: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            if getattr(module, "quant_method", None) is None:
                continue
            shards = set(getattr(module, "shard_ids", None) or (None,))
            self.waiting[module] = {}
            for name, param in module.named_parameters(recurse=False):
                self.waiting[module][name] = set(shards)
                owners.setdefault(id(param), []).append((module, name))
        # by every name the model calls a parameter (a tied LM head's weight is the embedding's)
        self.owners = {name: owners[id(p)] for name, p in model.named_parameters(remove_duplicate=False)
                       if id(p) in owners}

    def loaded(self, name: str, shard_id: Hashable) -> None:
        """load_weights' callback: parameter ``name`` received shard ``shard_id`` (None: all of it)."""
        for module, attr in self.owners.get(name, ()):
            waiting = self.waiting.get(module)
            if waiting is None or attr not in waiting:
                continue
            shards = waiting[attr]
            if shard_id is None:
                shards.clear()
            else:
                shards.discard(shard_id)
            if not shards:
                del waiting[attr]
            if not waiting:
                self._process(module)

    def _process(self, module: nn.Module) -> None:
        del self.waiting[module]
        method = module.quant_method
        method.process_weights_after_loading(module)  # repack (or quantize) once, never per forward
        if isinstance(module, LMHead):
            module.packed()  # a tied embedding may now read its rows from the packed head
        if not isinstance(method, UnquantizedLinearMethod):
            release_freed_heap()  # the weight it replaced, where malloc's heap (not an mmap) held it

    def finish(self) -> None:
        """Layers no checkpoint tensor completed (none, once load_weights found nothing missing)."""
        for module in list(self.waiting):
            self._process(module)


def release_freed_heap() -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim). A repacked layer's weight under
    keep_freed_host_memory's mmap threshold (worker/memory.py) is freed into malloc's free
    lists, which keep it resident; the packed tensors that follow seldom reuse those holes, so over
    a load-time INT8 load of a 1.5B model they grew to 1.3 GB that no tensor used, and the load's
    peak by about 1 GB. Best effort: a no-op off glibc."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):
        pass


def load_model(model_dir: str | Path, arch: ArchConfig, dtype: torch.dtype, device: torch.device, max_position: int,
               quant_config: QuantConfig | None = None, tp: TensorParallel = SINGLE,
               pooling: bool = False, vision_quantization: str | None = None) -> nn.Module:
    """The model, or under tensor parallelism rank ``tp.rank``'s shard of it, loaded; ``pooling``:
    its layers without the LM head (models/pooling.py); ``vision_quantization`` "w8a8": the image
    encoder's linears too."""
    if vision_quantization is not None and arch.images is None:
        raise ValueError("vision_quantization: this model reads no images")
    model_dir = Path(model_dir)
    gguf = model_dir / GGUF_LINK
    files = [] if gguf.exists() else find_weight_files(model_dir)
    model_cls = model_class_for(arch)
    if pooling and arch.encoder is None:  # an encoder has no LM head to leave out
        model_cls = pooling_variant(model_cls)
    if arch.rope_scaling.rope_type == "longrope":
        logger.info(describe_longrope(arch.rope_scaling, max_position))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), building_for(tp):
            model = model_cls(arch, max_position, quant_config)
    finally:
        torch.set_default_dtype(previous)
    repack = LayerwiseRepacking(model)
    weights = iterate_gguf_weights(gguf, arch) if gguf.exists() else iterate_weights(files)
    model.load_weights(weights, on_loaded=repack.loaded)
    repack.finish()
    if vision_quantization == "w8a8":
        logger.info("Image encoder: %d linears in W8A8", w8a8_linears(model.vision))
    release_freed_heap()
    return model.eval()
