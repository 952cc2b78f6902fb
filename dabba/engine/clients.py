"""The EngineClients a front end can be given, made in one place: one engine's (AsyncLLMEngine)
or data-parallel replicas' (DataParallelEngine); several models' router joins them here."""
from __future__ import annotations

from dabba.engine.async_engine import AsyncLLMEngine
from dabba.engine.data_parallel import DataParallelEngine
from dabba.engine.llm_engine import LLMEngine
from dabba.engine.protocol import EngineClient


def make_engine_client(engines: LLMEngine | list[LLMEngine], served_model_name: str,
                       start_thread: bool = True) -> EngineClient:
    """The client of one engine, or of a list of replicas of one model. Its engine loop runs on a
    thread of its own, or (``start_thread=False``) wherever the caller runs ``run_loop()``."""
    engines = engines if isinstance(engines, list) else [engines]
    if len(engines) == 1:
        return AsyncLLMEngine(engines[0], served_model_name, start_thread=start_thread)
    return DataParallelEngine(engines, served_model_name, start_thread=start_thread)
