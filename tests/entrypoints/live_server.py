"""The real API server of a tiny checkpoint on a free loopback port, for tests that drive it over HTTP."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Iterator

import uvicorn

from dabba.config import EngineConfig, ServerConfig
from dabba.engine.clients import make_engine_client
from dabba.engine.data_parallel import build_replicas
from dabba.engine.llm_engine import LLMEngine
from dabba.entrypoints.openai.api_server import build_app
from dabba.entrypoints.openai.run_server import uvicorn_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(path: str, model_name: str, api_key: str | None, tool_call_parser: str | None = None,
                config: ServerConfig | None = None, app_state: dict | None = None,
                reasoning_parser: str | None = None, lora_modules: dict[str, str] | None = None, **engine_options) -> Iterator[tuple[str, LLMEngine | list[LLMEngine]]]:
    """Yields (base URL, engine, or the replicas under data_parallel_size); stops the server on
    exit. ``app_state``, if given, receives the app's state (its EngineClient as "engine");
    ``engine_options`` add to the engine's."""
    engine_config = EngineConfig.from_kwargs(**{"model": path, "dtype": "float32", "max_num_batched_tokens": 256,
                                                **engine_options})
    engine = (LLMEngine(engine_config) if engine_config.parallel_config.data_parallel_size == 1 else
              build_replicas(engine_config))
    app = build_app(make_engine_client(engine, model_name), model_name, api_key=api_key,
                    tool_call_parser=tool_call_parser, config=config, reasoning_parser=reasoning_parser,
                    lora_modules=lora_modules)
    if app_state is not None:
        app_state["engine"] = app.state.engine_client
    try:
        with serving(app, config) as url:
            yield url, engine
    finally:
        for each in engine if isinstance(engine, list) else [engine]:
            each.shutdown()  # worker processes, if any


@contextlib.contextmanager
def serving(app, config: ServerConfig | None = None) -> Iterator[str]:
    """``app`` on uvicorn (as serve() runs it) on a free loopback port: yields its base URL."""
    # bound here and handed to uvicorn, so no other process can take the port in between
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, config or ServerConfig(), "warning"))  # as serve()
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120  # a bound on a hang only
    while not srv.started:
        assert thread.is_alive(), "server failed to start (see its log above)"
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
        sock.close()
