"""`dabba plan`: what a model's weights and KV cache take, and how many sequences fit, for each
combination of weight quantization and KV-cache dtype, without loading a weight.

    KV bytes = 2 (K and V) * B (sequences) * S (tokens each) * L * n_kv_heads * head_dim * p

plus, for 8-bit caches, a 4-byte scale per token, layer, K/V and KV head. Under tensor parallelism
every figure is one rank's: its shard of the weights, its KV heads (each rank caches every
sequence for its heads), and the memory given is each rank's. The figures are the engine's own
arithmetic (kv_bytes_per_token, each linear method's packed_bytes, the same block
rounding), so they equal what the engine allocates; tests hold them to it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from dabba.attention.kv_quant import KV_CACHE_DTYPES, kv_bytes_per_token
from dabba.config import EngineConfig, SchedulerConfig
from dabba.core.kv_cache_groups import group_layers, group_size
from dabba.distributed.tensor_parallel import KVHeadShard, check_split
from dabba.models.hub import CONFIG_FILES
from dabba.models.resolved_config import resolve_config
from dabba.models.sizes import parameter_counts, weights_bytes
from dabba.quantization.config import QuantConfig

WEIGHT_QUANTIZATIONS = (None, "int8", "int4")  # the rows of a plan asked for none; "w8a8" when asked (int8's bytes)


@dataclass
class PlanRow:
    quantization: str  # "none", "int8", "int4", "w8a8", or the checkpoint's own ("gptq", "awq")
    kv_cache_dtype: str
    weights_bytes: int
    kv_cache_memory: int  # the budget, or with total_memory what the weights leave of it
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    num_blocks: int  # in kv_cache_memory
    max_sequences: int  # of max_model_len tokens each, all in the cache at once
    load_seconds: float | None = None  # with load_time: predicted on this machine (tools/load_time.py)


@dataclass
class MemoryPlan:
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    p: int  # bytes per KV element at kv_cache_dtype "auto"
    formula: str
    kv_cache_memory: int | None
    total_memory: int | None
    max_model_len: int
    block_size: int
    rows: list[PlanRow] = field(default_factory=list)
    # with sliding-window layers: how the cache groups them (KV B/block is then a block of one
    # group's layers, and B/token counts every layer as if it kept the whole context)
    kv_cache_groups: str | None = None
    parameters: int = 0
    active_parameters: int = 0  # what one token's forward multiplies: fewer than all in a mixture of experts
    experts: str | None = None  # a mixture of experts: "top_k of num_experts experts in N of L layers"
    tensor_parallel_size: int = 1  # above 1: the weights, KV heads and memory are one rank's
    load_rates: dict | None = None  # with load_time: the rates measured here (bytes/s) and the fixed seconds

    def to_dict(self) -> dict:
        return asdict(self)

    def render(self) -> str:
        mib = 2**20
        lines = [
            f"{self.model}: L={self.num_layers} layers, n_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"dtype {self.dtype} (p={self.p})"
            + (f"; one rank of tensor_parallel_size={self.tensor_parallel_size} (its weights, its KV heads, "
               "its memory)" if self.tensor_parallel_size > 1 else ""),
            f"parameters: {self.parameters / 1e6:.1f}M"
            + (f", {self.active_parameters / 1e6:.1f}M active per token ({self.experts})" if self.experts else ""),
            f"KV bytes = {self.formula}",
            (f"KV cache memory {self.kv_cache_memory / mib:.1f} MiB" if self.total_memory is None else
             f"{self.total_memory / mib:.1f} MiB in all, the KV cache gets what the weights leave")
            + f"; blocks of {self.block_size} tokens, sequences of max_model_len={self.max_model_len} tokens",
            *([f"KV-cache groups: {self.kv_cache_groups}"] if self.kv_cache_groups else []),
            "",
            f"{'weights':>8} {'kv dtype':>8} {'weights MiB':>12} {'KV MiB':>9} {'KV B/token':>11} {'KV B/block':>11} "
            f"{'blocks':>8} {'sequences':>10}",
        ]
        if self.load_rates:
            lines[-1] += f" {'load s':>7}"
        for r in self.rows:
            lines.append(f"{r.quantization:>8} {r.kv_cache_dtype:>8} {r.weights_bytes / mib:>12.1f} "
                         f"{r.kv_cache_memory / mib:>9.1f} {r.kv_bytes_per_token:>11} {r.kv_bytes_per_block:>11} "
                         f"{r.num_blocks:>8} {r.max_sequences:>10}"
                         + (f" {r.load_seconds:>7.1f}" if r.load_seconds is not None else ""))
        if self.load_rates:
            rates = self.load_rates
            lines.append(f"load s = {rates['fixed']:.2f} s fixed + checkpoint bytes / {rates['read'] / 2**30:.2f} GiB/s "
                         f"read + / the method's processing rate + KV bytes / {rates['zero'] / 2**30:.2f} GiB/s "
                         "zeroed (measured here, now)")
        return "\n".join(lines)


def plan(model: str | Path, kv_cache_memory: int | None = 4 * 2**30, max_model_len: int | None = None,
         quantization: str | None = None, kv_cache_dtype: str | None = None, dtype: str = "auto",
         block_size: int = 16, device_type: str = "cpu", total_memory: int | None = None,
         revision: str | None = None, download_dir: str | None = None,
         max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
         tensor_parallel_size: int = 1, load_time: bool = False) -> MemoryPlan:
    """Every combination, or only the given ``quantization`` ("none" for unquantized weights) /
    ``kv_cache_dtype``. With
    ``total_memory`` the KV cache gets what each row's weights leave of it (as on a GPU of that
    size), so smaller weights mean more sequences. ``tensor_parallel_size``: one rank's figures. A
    Hub repo id ``model`` costs only its config.json: nothing here reads weights, but for
    ``load_time`` (each row's load predicted from rates measured here: tools/load_time.py), which
    reads a sample of the checkpoint's files."""
    if (kv_cache_memory is None) == (total_memory is None):
        raise ValueError("give exactly one of kv_cache_memory and total_memory")
    # As the engine resolves it (the device is this plan's, not this machine's): the config files alone
    resolved = resolve_config(EngineConfig.from_kwargs(model=str(model), revision=revision, download_dir=download_dir,
                                                       dtype=dtype, max_model_len=max_model_len, device="cpu"),
                              CONFIG_FILES)
    arch, torch_dtype, max_len = resolved.arch, resolved.dtype, resolved.max_model_len
    if arch.quantization_config:
        if quantization:
            raise ValueError(f"quantization={quantization!r}: this checkpoint is already quantized")
        weight_options = [(resolved.quant_config.method, resolved.quant_config)]
    else:
        if quantization not in WEIGHT_QUANTIZATIONS + ("none", "w8a8"):
            raise ValueError(f"quantization must be 'none', 'int8', 'int4', 'w8a8' or None (all), got {quantization!r}")
        chosen = WEIGHT_QUANTIZATIONS if quantization is None else [None if quantization == "none" else quantization]
        weight_options = [(q or "none", QuantConfig(q) if q else None) for q in chosen]
    if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    tp = tensor_parallel_size
    if tp > 1:
        check_split(tp, arch.num_attention_heads, arch.num_key_value_heads)
    L, d, p = arch.num_hidden_layers, arch.head_dim, torch_dtype.itemsize
    H = KVHeadShard.of(0, tp, arch.num_key_value_heads).num_local  # every rank holds as many
    result = MemoryPlan(str(model), L, H, d, str(torch_dtype).removeprefix("torch."), p,
                        f"2 · B · S · L · n_kv_heads · head_dim · p = 2 · B · S · {L} · {H} · {d} · {p} "
                        f"= {2 * L * H * d * p} · B · S bytes", kv_cache_memory, total_memory, max_len, block_size,
                        tensor_parallel_size=tp)
    result.parameters, result.active_parameters = parameter_counts(arch)
    if arch.moe is not None:
        result.experts = (f"{arch.moe.top_k} of {arch.moe.num_experts} experts in {sum(arch.moe.sparse_layers)} "
                          f"of {L} layers")
    # As the engine: layers grouped by attention kind, a pool block holding one block of each layer
    # position of a group; a sliding group holds at most its window plus a step's chunk.
    groups = group_layers([arch.layer_sliding_window(i) for i in range(L)])
    null_block = any(g.sliding_window is not None for g in groups)
    blocks_per_seq = sum(g.blocks_needed(max_len, block_size, max_num_batched_tokens) for g in groups)
    if null_block:
        windows = sorted({g.sliding_window for g in groups if g.sliding_window is not None})
        num_sliding = sum(len(g.layer_ids) for g in groups if g.sliding_window is not None)
        result.kv_cache_groups = (f"{len(groups)} groups of {group_size(groups)} layers; {num_sliding} of {L} layers "
                                  f"slide (window {', '.join(map(str, windows))}) and hold at most window + "
                                  f"max_num_batched_tokens={max_num_batched_tokens} tokens")
    for name, qc in weight_options:
        w_bytes = weights_bytes(arch, torch_dtype, qc, device_type, tp_size=tp)
        for kv in [kv_cache_dtype] if kv_cache_dtype else KV_CACHE_DTYPES:
            per_token = kv_bytes_per_token(L, H, d, kv, torch_dtype)
            per_block = kv_bytes_per_token(group_size(groups), H, d, kv, torch_dtype) * block_size
            budget = kv_cache_memory if total_memory is None else max(total_memory - w_bytes, 0)
            num_blocks = budget // per_block
            row = PlanRow(name, kv, w_bytes, budget, per_token, per_block, num_blocks,
                          max(num_blocks - null_block, 0) // blocks_per_seq)
            if load_time:
                from dabba.tools.load_time import predict_load_time

                result.load_rates = result.load_rates or {}
                row.load_seconds = predict_load_time(
                    resolved.model_dir, resolved.tokenizer_dir, arch, torch_dtype, qc, num_blocks * per_block,
                    resolved.config.model_config.gguf_file, result.load_rates)
            result.rows.append(row)
    if result.load_rates:  # JSON-friendly: the processing rates by method
        result.load_rates = {k if isinstance(k, str) else f"process_{k[1] or 'none'}": v
                             for k, v in result.load_rates.items()}
    return result
