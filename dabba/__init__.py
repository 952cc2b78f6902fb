"""dabba: a small, clear LLM serving engine with a paged KV cache and continuous batching.

The public names are imported lazily (PEP 562): `import dabba.core.scheduler` runs this file first,
and `core/` must stay free of torch, so nothing here may import torch (or anything that does) at
import time. `from dabba import LLM` imports `dabba.entrypoints.llm` on first use.
"""
import importlib as _importlib
import typing as _typing

from dabba.logger import init_logger as _init_logger

_init_logger()

if _typing.TYPE_CHECKING:
    from dabba.entrypoints.llm import LLM
    from dabba.lora_request import LoRARequest
    from dabba.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
    from dabba.pooling_params import PoolingParams
    from dabba.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "PoolingParams",
           "PoolingRequestOutput", "LoRARequest"]
__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY_ATTRS = {
    "LLM": "dabba.entrypoints.llm",
    "SamplingParams": "dabba.sampling_params",
    "RequestOutputKind": "dabba.sampling_params",
    "RequestOutput": "dabba.outputs",
    "CompletionOutput": "dabba.outputs",
    "PoolingParams": "dabba.pooling_params",
    "PoolingRequestOutput": "dabba.outputs",
    "LoRARequest": "dabba.lora_request",
}


def __getattr__(name: str) -> _typing.Any:
    module_name = _LAZY_ATTRS.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups find it directly
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
