"""The worker's LoRA adapters: ``max_loras`` slots in every adaptable linear layer (attention and
MLP projections), filled from PEFT directories when a step first needs an adapter, the least
recently used adapter no step needs giving its slot up; and each step's rows of each adapter.
The scheduler sees to it that one step never needs more adapters than there are slots. Adapters
read lately stay parsed in host memory (twice the slots, at least 8), so a swap back reads no files."""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from dabba.layers.linear import Linear
from dabba.layers.lora import LoRASlots, StepRows
from dabba.lora_request import LoRARequest
from dabba.models.lora_adapter import PeftAdapter, read_peft_adapter

# the linear layers adapters may target, by the end of their names (PEFT's target_modules of
# q/k/v/o_proj and gate/up/down_proj, merged as dabba's layers are)
ADAPTABLE = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.layers: dict[str, Linear] = {}
        for name, module in model.named_modules():
            if isinstance(module, Linear) and name.rsplit(".", 1)[-1] in ADAPTABLE:
                if module.parallel is not None:
                    raise ValueError("enable_lora with tensor_parallel_size > 1 is not supported yet")
                module.lora = LoRASlots(module.in_features, module.output_sizes, max_loras, max_rank, dtype, device)
                self.layers[name] = module
        if not self.layers:
            raise ValueError(f"enable_lora: {type(model).__name__} has no layers adapters can target")
        self.resident: OrderedDict[str, int] = OrderedDict()  # adapter identity -> slot, least recent first
        self.parsed: OrderedDict[str, PeftAdapter] = OrderedDict()  # read lately, least recent first
        self.max_parsed = max(2 * max_loras, 8)

    def slots_for(self, loras: dict[str, LoRARequest]) -> dict[str, int]:
        """Each adapter's slot (``loras``: by identity, those a step needs), loading those not resident."""
        if len(loras) > self.max_loras:
            raise RuntimeError(f"a step needs {len(loras)} adapters, past max_loras {self.max_loras}")
        for identity in loras:
            if identity in self.resident:
                self.resident.move_to_end(identity)
        for identity, lora in loras.items():
            if identity in self.resident:
                continue
            free = sorted(set(range(self.max_loras)) - set(self.resident.values()))
            if free:
                slot = free[0]
            else:
                victim = next(i for i in self.resident if i not in loras)
                slot = self.resident.pop(victim)
            self._load(lora, slot)
            self.resident[identity] = slot
        return {identity: self.resident[identity] for identity in loras}

    def _read(self, lora: LoRARequest) -> PeftAdapter:
        adapter = self.parsed.pop(lora.identity, None) or read_peft_adapter(lora.lora_path, self.max_rank)
        self.parsed[lora.identity] = adapter
        while len(self.parsed) > self.max_parsed:
            self.parsed.popitem(last=False)
        return adapter

    def _load(self, lora: LoRARequest, slot: int) -> None:
        adapter = self._read(lora)
        for layer in self.layers.values():
            layer.lora.clear(slot)
        for module_name, (a, b) in adapter.modules.items():
            target, shard = self.model.checkpoint_target(f"{module_name}.weight")
            layer_name = target.rsplit(".", 1)[0]
            layer = self.layers.get(layer_name)
            if layer is None:
                raise ValueError(f"LoRA adapter {lora.lora_path}: {module_name} is not a layer adapters can target "
                                 f"here (the attention and MLP projections)")
            index = layer.shard_ids.index(shard) if layer.shard_ids else 0
            layer.lora.set_shard(slot, index, a, b, adapter.scaling, f"LoRA adapter {lora.lora_path}: {module_name}")

    def step_rows(self, loras: list[LoRARequest | None], num_tokens: list[int],
                  device: torch.device) -> StepRows | None:
        """(slot, its rows of the flat batch) per adapter: ``loras`` and ``num_tokens`` per request, in
        batch order; None where no request has an adapter."""
        wanted = {lora.identity: lora for lora in loras if lora is not None}
        if not wanted:
            return None
        slots = self.slots_for(wanted)
        rows: dict[int, list[int]] = {}
        start = 0
        for lora, n in zip(loras, num_tokens):
            if lora is not None:
                rows.setdefault(slots[lora.identity], []).extend(range(start, start + n))
            start += n
        return StepRows.of([(slot, torch.tensor(index, dtype=torch.long, device=device)) for slot, index in rows.items()])
