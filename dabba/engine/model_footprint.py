"""What a model takes in memory once loaded, known before a weight is read: its weights (each
linear method's packed bytes, as `dabba plan` counts them) and its KV cache. A server of several
models asks this before each load, to unload others until the next one fits."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dabba.attention.kv_quant import kv_bytes_per_token
from dabba.config import EngineConfig
from dabba.core.kv_cache_groups import group_layers, group_size
from dabba.distributed.tensor_parallel import KVHeadShard
from dabba.models.hub import CONFIG_FILES
from dabba.models.resolved_config import resolve_config
from dabba.models.sizes import weights_bytes
from dabba.worker.memory import CPU_KV_MAX, kv_bytes_for_sequences


@dataclass(frozen=True)
class Footprint:
    weights_bytes: int
    kv_cache_bytes: int

    @property
    def total(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes


def plan_footprint(config: EngineConfig) -> tuple[Footprint, EngineConfig]:
    """The model's footprint, and ``config`` with its KV budget made explicit (the engine's
    default is a share of the memory free when it loads, which other models' loads would move):
    what the engine would size it to on an empty machine, so it allocates what was planned. Reads
    config files only (a Hub id fetches its config.json)."""
    resolved = resolve_config(config, CONFIG_FILES)
    arch, dtype = resolved.arch, resolved.dtype
    tp = config.parallel_config.tensor_parallel_size
    weights = weights_bytes(arch, dtype, resolved.quant_config, resolved.device.type, tp_size=tp)
    cc, sc = config.cache_config, config.scheduler_config
    if cc.kv_cache_memory is not None:
        return Footprint(weights, cc.kv_cache_memory), config
    if arch.encoder is not None:  # an encoder keeps no KV past a step: the engine sizes its own buffers
        return Footprint(weights, 0), config
    groups = group_layers([arch.layer_sliding_window(i) for i in range(arch.num_hidden_layers)])
    num_kv_heads = KVHeadShard.of(0, tp, arch.num_key_value_heads).num_local
    bytes_per_block = cc.block_size * kv_bytes_per_token(group_size(groups), num_kv_heads, arch.head_dim,
                                                         cc.kv_cache_dtype, dtype)
    wanted = kv_bytes_for_sequences(groups, cc.block_size, bytes_per_block, resolved.max_model_len, sc.max_num_seqs,
                                    sc.max_num_batched_tokens)
    kv = min(wanted, CPU_KV_MAX)
    return Footprint(weights, kv), dataclasses.replace(config, cache_config=dataclasses.replace(cc, kv_cache_memory=kv))
