"""The LoRA adapters a server serves by name (vLLM's ``--lora-modules`` and its load and unload
endpoints): a request's ``model`` field names the base model or one of them. Each load gets an
id of its own, so an adapter unloaded and loaded again from other files never shares prefix-cache
blocks with its earlier self; requests in flight keep the adapter they started with."""
from __future__ import annotations

import itertools
import threading

from dabba.engine.protocol import ModelInfo
from dabba.lora_request import LoRARequest


def parse_lora_modules(specs: list[str]) -> dict[str, str]:
    """``name=path`` items (the CLI's --lora-modules) -> {name: path}; ValueError naming the bad one."""
    modules: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules takes name=path items, got {spec!r}")
        if name.strip() in modules:
            raise ValueError(f"--lora-modules names {name.strip()!r} twice")
        modules[name.strip()] = path.strip()
    return modules


class AdapterRegistry:
    def __init__(self, model_info: ModelInfo, served_model_name: str) -> None:
        self.model_info, self.served_model_name = model_info, served_model_name
        self._adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def get(self, name: str) -> LoRARequest | None:
        return self._adapters.get(name)

    def all(self) -> list[LoRARequest]:
        return list(self._adapters.values())

    def load(self, name: str, path: str) -> LoRARequest:
        """Read and check the adapter (a ValueError says what is wrong), then serve it as ``name``.
        Reads files: call it off the event loop."""
        limits = self.model_info.lora
        if limits is None:
            raise ValueError("this server serves no LoRA adapters (start it with --enable-lora)")
        if not isinstance(name, str) or not name or name == self.served_model_name:
            raise ValueError(f"lora_name must be a name other than the base model's, got {name!r}")
        if name in self._adapters:
            raise ValueError(f"the adapter {name!r} is already loaded (unload it first)")
        with self._lock:
            lora = LoRARequest(name, next(self._ids), path)
        limits.read(path)
        with self._lock:
            if name in self._adapters:
                raise ValueError(f"the adapter {name!r} is already loaded (unload it first)")
            self._adapters[name] = lora
        return lora

    def unload(self, name: str) -> None:
        """KeyError when no adapter of that name is served."""
        with self._lock:
            del self._adapters[name]
