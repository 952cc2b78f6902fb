"""The options of a server of several models (`dabba serve --model NAME=PATH ...` or
--models-file): flags generated from this dataclass, as the engine's are from config.py."""
from __future__ import annotations

from dataclasses import dataclass

from dabba.config_fields import _help, parse_bytes, parse_duration


@dataclass(frozen=True)
class RouterConfig:
    """How a server of several models loads and unloads them (used with --model NAME=PATH or
    --models-file)."""

    models_file: str | None = _help(
        "A YAML or JSON file of the models to serve (name, model, engine options, keep_alive, parsers, "
        "lora_modules each); they load on first use.", None)
    keep_alive: float = _help(
        "Seconds a model stays loaded with no request in flight (Ollama's keep_alive: also '5m', '1h'; negative: "
        "for good; 0: unloaded once idle); a request's keep_alive field sets its model's from then on.", 300.0,
        parse=parse_duration)
    models_memory: int | None = _help(
        "Bytes the loaded models may take in all (weights plus KV caches, as `dabba plan` counts them); a load "
        "unloads the least recently used idle models until it fits. Default: 90% of the memory available at start. "
        "Accepts sizes such as 16GiB.", None, parse=parse_bytes)
    max_waiting_per_model: int = _help(
        "Most requests waiting for one model to load or unload; the next is answered 503 with Retry-After.", 64)

    def __post_init__(self) -> None:
        if self.max_waiting_per_model < 1:
            raise ValueError(f"max_waiting_per_model must be >= 1, got {self.max_waiting_per_model}")
        if self.models_memory is not None and self.models_memory < 1:
            raise ValueError(f"models_memory must be a positive number of bytes, got {self.models_memory}")
