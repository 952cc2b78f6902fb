"""A PEFT LoRA adapter read from its directory (adapter_config.json, adapter_model.safetensors),
defensively: the files come from strangers, so every field and tensor the engine relies on is
checked, and anything it would not apply as PEFT does is refused with a ValueError naming it."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dabba.arch.config import ArchConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's names: the wrapped model's modules under this


@dataclass
class PeftAdapter:
    rank: int
    scaling: float  # lora_alpha / rank, or / sqrt(rank) with rsLoRA: what B A x is multiplied by
    # the base model's module name (as its checkpoint names it) -> (A [rank, in], B [out, rank])
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    base_model: str | None


def _refuse_unless(ok: bool, path: Path, message: str) -> None:
    if not ok:
        raise ValueError(f"LoRA adapter {path}: {message}")


def read_config(path: Path, max_rank: int) -> tuple[int, float, str | None]:
    """(rank, scaling, base model) from adapter_config.json."""
    file = path / CONFIG_FILE
    _refuse_unless(file.is_file(), path, f"no {CONFIG_FILE} (not a PEFT adapter directory)")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {path}: {CONFIG_FILE} is not readable JSON: {e}") from None
    _refuse_unless(isinstance(cfg, dict), path, f"{CONFIG_FILE} must hold a JSON object")
    _refuse_unless(cfg.get("peft_type", "LORA") == "LORA", path, f"peft_type {cfg.get('peft_type')!r}: only LORA")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    _refuse_unless(isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1, path,
                   f"r must be an integer >= 1, got {rank!r}")
    _refuse_unless(rank <= max_rank, path, f"rank {rank} is larger than max_lora_rank {max_rank}")
    _refuse_unless(isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and math.isfinite(alpha), path,
                   f"lora_alpha must be a number, got {alpha!r}")
    for name, allowed in (("use_dora", (False, None)), ("fan_in_fan_out", (False, None)), ("bias", ("none", None)),
                          ("modules_to_save", (None, [])), ("rank_pattern", ({}, None)), ("alpha_pattern", ({}, None)),
                          ("layer_replication", (None,))):
        _refuse_unless(cfg.get(name) in allowed, path, f"{name}={cfg.get(name)!r} is not supported")
    rslora = cfg.get("use_rslora", False)
    _refuse_unless(isinstance(rslora, bool), path, f"use_rslora must be true or false, got {rslora!r}")
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    base = cfg.get("base_model_name_or_path")
    return rank, float(scaling), base if isinstance(base, str) else None


def read_peft_adapter(path: str | Path, max_rank: int) -> PeftAdapter:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    _refuse_unless(path.is_dir(), path, "not a directory")
    rank, scaling, base = read_config(path, max_rank)
    file = path / WEIGHTS_FILE
    _refuse_unless(file.is_file(), path, f"no {WEIGHTS_FILE} (adapter weights are read from safetensors only)")
    try:
        tensors = load_file(file)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"LoRA adapter {path}: {WEIGHTS_FILE} is not a readable safetensors file: {e}") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        module, dot, rest = name.removeprefix(PREFIX).rpartition(".lora_")
        _refuse_unless(name.startswith(PREFIX) and dot and rest in ("A.weight", "B.weight"), path,
                       f"tensor {name!r} is not a LoRA A or B weight")
        _refuse_unless(tensor.dim() == 2 and tensor.is_floating_point(), path,
                       f"{name} must be a 2-D float tensor, got {tuple(tensor.shape)} {tensor.dtype}")
        _refuse_unless(bool(torch.isfinite(tensor).all()), path, f"{name} holds NaN or infinite values")
        halves.setdefault(module, {})[rest[0]] = tensor
    modules = {}
    for module, pair in sorted(halves.items()):
        _refuse_unless(set(pair) == {"A", "B"}, path, f"{module} has lora_{next(iter(pair))} without its other half")
        a, b = pair["A"], pair["B"]
        _refuse_unless(a.shape[0] == rank and b.shape[1] == rank, path,
                       f"{module}: A {tuple(a.shape)} and B {tuple(b.shape)} are not of rank {rank}")
        modules[module] = (a, b)
    _refuse_unless(bool(modules), path, "holds no LoRA weights")
    return PeftAdapter(rank, scaling, modules, base)


# PEFT's module names in Llama-style checkpoints (the separate projections, and Phi-3's merged ones)
# -> (inputs, outputs) from the architecture
def _shapes(arch: "ArchConfig") -> dict[str, tuple[int, int]]:
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "qkv_proj": (h, q + 2 * kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "gate_up_proj": (h, 2 * i), "down_proj": (i, h)}


@dataclass(frozen=True)
class AdapterLimits:
    """What an adapter must fit to run on this engine's model, checked before its request is taken."""

    max_rank: int
    num_layers: int
    shapes: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, arch: "ArchConfig", max_rank: int) -> "AdapterLimits":
        return cls(max_rank, arch.num_hidden_layers, _shapes(arch) if arch.moe is None else
                   {k: v for k, v in _shapes(arch).items() if k in ("q_proj", "k_proj", "v_proj", "o_proj")})

    def read(self, path: str | Path) -> PeftAdapter:
        """The adapter at ``path``, if it fits (a ValueError saying why not)."""
        adapter = read_peft_adapter(path, self.max_rank)
        self.check(adapter, path)
        return adapter

    def check(self, adapter: PeftAdapter, path: str | Path) -> None:
        path = Path(path)
        for module, (a, b) in adapter.modules.items():
            parts = module.split(".")
            ok = (len(parts) == 5 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
                  and parts[3] in ("self_attn", "mlp") and parts[4] in self.shapes)
            _refuse_unless(ok, path, f"{module} is not a layer adapters can target here (the attention and MLP "
                                     f"projections: {', '.join(self.shapes)})")
            _refuse_unless(int(parts[2]) < self.num_layers, path,
                           f"{module}: the model has {self.num_layers} layers")
            inputs, outputs = self.shapes[parts[4]]
            _refuse_unless(a.shape[1] == inputs and b.shape[0] == outputs, path,
                           f"{module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the model's "
                           f"{inputs} inputs and {outputs} outputs (an adapter of another base model?)")
