"""Which implementation runs a model's layers each step, chosen once per model, here: the Python
layers (the reference) or the native layer loop, the same layers in C++ (models/native_layer_loop.py).
The target model and a speculative draft model each make this choice for themselves."""
from __future__ import annotations

from typing import Any

import torch

from dabba.attention.backend import AttentionBackend, forward_context
from dabba.attention.cpu import CpuBackend
from dabba.attention.kv_quant import KVQuant
from dabba.distributed.shm_communicator import ShmCommunicator
from dabba.distributed.tensor_parallel import SINGLE, TensorParallel
from dabba.layers.embedding import EmbeddingRows
from dabba.models.native_layer_loop import NativeLayerLoop, missing_native_form


def select_layer_loop(model: torch.nn.Module, backend: AttentionBackend, kv_quant: KVQuant | None,
                      setting: str, tp: TensorParallel = SINGLE,
                      lora: bool = False) -> tuple[NativeLayerLoop | None, str]:
    """The native loop or None (the Python layers), and why. The native loop reads the CPU
    backend's cache layout and must compute exactly what the Python layers do; "auto" takes it
    where both hold, "on" insists, "off" never takes it. A tensor-parallel rank's loop sums over
    its group through the group's shared-memory segment, so it runs where the ranks share a host."""
    if setting == "off":
        return None, "native_layer_loop='off'"
    if tp.size > 1 and not isinstance(tp.communicator, ShmCommunicator):
        why = (f"tensor_parallel_size={tp.size} over torch.distributed (the loop's collectives go through the "
               "shared memory of ranks on one host)")
    elif lora:
        why = "enable_lora (the adapters' products are added in the Python layers)"
    elif not isinstance(backend, CpuBackend):
        why = f"the {type(backend).__name__} attention backend (the loop reads the CPU backend's cache)"
    else:
        why = missing_native_form(model)
    if why is None:
        loop = NativeLayerLoop(model, kv_quant, tp)  # the loop writes and reads 8-bit caches too
        ranks = f", summing over {tp.size} ranks through shared memory" if tp.size > 1 else ""
        return loop, f"native_layer_loop={setting!r}, and every layer has a native form{ranks}"
    if setting == "on":
        raise ValueError(f"native_layer_loop='on', but {why}; use 'auto' or 'off'")
    return None, why


def run_layers(model: torch.nn.Module, native_loop: NativeLayerLoop | None, backend: AttentionBackend,
               input_ids: torch.Tensor, positions: torch.Tensor, metadata: list[Any], kv_caches: list[Any],
               layer_groups: list[int] | None = None, token_type_ids: torch.Tensor | None = None,
               image_embeds: EmbeddingRows | None = None) -> torch.Tensor:
    """The final hidden states [num_tokens, hidden] of one flat batch (``token_type_ids``: an
    encoder's text pairs; ``image_embeds``: a vision-language model's image rows)."""
    with forward_context(backend, metadata, kv_caches, layer_groups, token_type_ids):
        if native_loop is not None:
            return native_loop(input_ids, positions, metadata, kv_caches, layer_groups, image_embeds)
        if image_embeds is not None:
            return model(input_ids, positions, image_embeds)
        return model(input_ids, positions)
