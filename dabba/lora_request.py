"""Which LoRA adapter a request runs with, as vLLM spells it: plain data, no torch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter (a directory holding adapter_config.json and adapter_model.safetensors) by
    ``lora_name``, with ``lora_int_id`` a positive integer that names these weights: requests of
    one id share prefix-cache blocks, of different ids (or the base model) never."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request.lora_path must be a directory path, got {self.lora_path!r}")

    @property
    def identity(self) -> str:
        """What the prefix cache keys blocks with and the worker's slots hold."""
        return f"{self.lora_int_id}:{self.lora_name}"
