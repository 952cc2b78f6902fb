"""dabba: a small, clear LLM serving engine with a paged KV cache and continuous batching."""
from dabba.entrypoints.llm import LLM
from dabba.outputs import CompletionOutput, RequestOutput
from dabba.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
