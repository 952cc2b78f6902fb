"""The models a server of several models serves, from a models file or repeated ``--model
NAME=PATH`` flags, and the router's own options (flags generated from RouterConfig).

A models file (YAML or JSON):

    keep_alive: 5m                      # optional: every model's, unless its own says otherwise
    models:
      - name: chat                      # the request's "model"
        model: /models/qwen2.5-1.5b     # a checkpoint directory, Hub repo id or GGUF file
        quantization: int8              # any engine option (dabba serve's flags, with underscores)
        max_model_len: 8192
        keep_alive: 1h                  # Ollama's durations, or seconds; negative: for good
        tool_call_parser: hermes        # how this model's replies write tool calls and reasoning
        reasoning_parser: qwen3
        lora_modules: {sql: /adapters/sql}   # adapters of this model (needs enable_lora: true)
      - name: embed
        model: /models/bge-base

Engine options given as flags are every model's defaults; a model's own entries override them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dabba.config import EngineConfig
from dabba.config_fields import parse_keep_alive
from dabba.engine.model_router import ModelSpec
from dabba.entrypoints.openai.model_servings import ServingOptions
from dabba.entrypoints.openai.reasoning import REASONING_PARSERS
from dabba.entrypoints.openai.tool_call_parsers import TOOL_CALL_PARSERS

SERVING_KEYS = ("tool_call_parser", "reasoning_parser")
OWN_KEYS = ("name", "model", "keep_alive", "lora_modules", *SERVING_KEYS)


@dataclass(frozen=True)
class ServedModel:
    spec: ModelSpec
    options: ServingOptions = ServingOptions()
    lora_modules: dict[str, str] = field(default_factory=dict)


def parse_model_flags(items: list[str], engine_defaults: dict[str, Any], keep_alive: float | None,
                      options: ServingOptions) -> list[ServedModel]:
    """``--model NAME=PATH`` items, each with the engine flags given."""
    models = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--model takes NAME=PATH, got {item!r}")
        models.append(_served({"name": name.strip(), "model": path.strip()}, engine_defaults, keep_alive,
                              f"--model {item}", options))
    return models


def read_models_file(path: str, engine_defaults: dict[str, Any], keep_alive: float | None,
                     options: ServingOptions) -> list[ServedModel]:
    """The models a models file lists; ValueError naming the file and the entry at fault."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read the models file {path}: {e.strerror}") from None
    data = _parse(text, path)
    if not isinstance(data, dict) or not isinstance(data.get("models"), list) or not data["models"]:
        raise ValueError(f"{path}: expected a mapping with a non-empty list 'models'")
    unknown = sorted(set(data) - {"models", "keep_alive"})
    if unknown:
        raise ValueError(f"{path}: unknown top-level keys {unknown} (expected 'models', 'keep_alive')")
    if "keep_alive" in data:
        keep_alive = parse_keep_alive(data["keep_alive"], f"{path}: keep_alive")
    models = []
    for i, entry in enumerate(data["models"]):
        where = f"{path}: models[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be a mapping, got {type(entry).__name__}")
        models.append(_served(entry, engine_defaults, keep_alive, where, options))
    names = [m.spec.name for m in models]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: model names must differ, got {names}")
    return models


def _parse(text: str, path: str) -> Any:
    if path.endswith(".json"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not valid YAML: {e}") from None


def _served(entry: dict[str, Any], engine_defaults: dict[str, Any], keep_alive: float | None, where: str,
            options: ServingOptions) -> ServedModel:
    name, model = entry.get("name"), entry.get("model")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: 'name' must be a non-empty string")
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"{where} ({name}): 'model' must be a checkpoint path or Hub repo id")
    if "keep_alive" in entry:
        keep_alive = parse_keep_alive(entry["keep_alive"], f"{where} ({name}): keep_alive")
    lora_modules = entry.get("lora_modules") or {}
    if not isinstance(lora_modules, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in lora_modules.items()):
        raise ValueError(f"{where} ({name}): 'lora_modules' must map adapter names to paths")
    for key, known in (("tool_call_parser", TOOL_CALL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
        if entry.get(key) is not None and entry[key] not in known:
            raise ValueError(f"{where} ({name}): '{key}' must be one of {sorted(known)}, got {entry[key]!r}")
    serving = ServingOptions(**{k: entry.get(k, getattr(options, k)) for k in SERVING_KEYS})
    engine_options = {**engine_defaults, **{k: v for k, v in entry.items() if k not in OWN_KEYS}}
    try:
        config = EngineConfig.from_kwargs(model=model.strip(), **engine_options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where} ({name}): {e}") from None
    if config.parallel_config.data_parallel_size > 1:
        raise ValueError(f"{where} ({name}): data_parallel_size > 1 is not served beside other models")
    if lora_modules and not config.lora_config.enable_lora:
        raise ValueError(f"{where} ({name}): lora_modules needs enable_lora: true")
    return ServedModel(ModelSpec(name.strip(), config, keep_alive), serving, dict(lora_modules))
