"""dabba: a small, clear LLM serving engine with a paged KV cache and continuous batching."""
from dabba.logger import init_logger

init_logger()

from dabba.entrypoints.llm import LLM  # noqa: E402
from dabba.outputs import CompletionOutput, RequestOutput  # noqa: E402
from dabba.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
