"""Running the app (api_server.py) until SIGINT/SIGTERM, then draining it: uvicorn on a thread
of its own, the engines' loop on the main thread (see AsyncLLMEngine)."""
from __future__ import annotations

import logging
import signal
import threading
from typing import Protocol

import uvicorn
from fastapi import FastAPI

from dabba.config import ServerConfig
from dabba.engine.protocol import EngineClient
from dabba.entrypoints.openai.api_server import build_app
from dabba.entrypoints.openai.http_protocol import protocol_class, raise_open_file_limit

logger = logging.getLogger("dabba")


class Lifecycle(Protocol):
    """What runs the engines behind an app: one EngineClient, or a ModelRouter of several."""

    def run_loop(self) -> None: ...

    def drain(self, timeout: float) -> bool: ...

    def shutdown(self) -> None: ...

    @property
    def error(self) -> BaseException | None: ...

    @property
    def is_running(self) -> bool: ...

    @property
    def is_draining(self) -> bool: ...


# The exit status of `dabba serve`: 0 after a clean drain, these otherwise (2: bad arguments or
# model, from the CLI).
EXIT_ENGINE_FAILED = 1
EXIT_DRAIN_TIMED_OUT = 3


def uvicorn_config(app: FastAPI, host: str, port: int, config: ServerConfig, log_level: str) -> uvicorn.Config:
    """How serve() runs ``app``: on dabba's HTTP/1.1 protocol (head deadline, connection cap, JSON
    errors; see http_protocol.py), named as a class so installed parsers never change it; uvicorn's
    graceful timeout outlasts the drain, so that by then every response has its ending."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol_class(config),
                          timeout_graceful_shutdown=config.shutdown_timeout + 10)


def serve(client: EngineClient, served_model_name: str, host: str, port: int, api_key: str | None,
          tool_call_parser: str | None = None, config: ServerConfig | None = None,
          reasoning_parser: str | None = None, lora_modules: dict[str, str] | None = None) -> int:
    """Serve one model (``client`` made with start_thread=False: its loop runs here, on the main
    thread; see AsyncLLMEngine) until SIGINT/SIGTERM: run_app's exit status."""
    config = config or ServerConfig()
    app = build_app(client, served_model_name, api_key, tool_call_parser=tool_call_parser, config=config,
                    reasoning_parser=reasoning_parser, lora_modules=lora_modules)
    return run_app(app, client, host, port, config, served_model_name)


def run_app(app: FastAPI, engines: Lifecycle, host: str, port: int, config: ServerConfig, what: str) -> int:
    """Run until SIGINT/SIGTERM, then drain: new requests are refused (503), those in flight get
    ``config.shutdown_timeout`` seconds to finish, and any still running end with an error (an
    error event and [DONE] for a stream, a 503 body otherwise). Returns the exit status: 0 after
    a clean drain, EXIT_DRAIN_TIMED_OUT if requests were cut, EXIT_ENGINE_FAILED if the engine
    loop failed (so a supervisor restarts the process). The engines' loop runs on this thread."""
    raise_open_file_limit(config.max_connections)
    log_level = logging.getLevelName(logger.getEffectiveLevel()).lower()  # dabba's (--log-level)
    server = uvicorn.Server(uvicorn_config(app, host, port, config, log_level))
    status: dict[str, int] = {}
    stopping = threading.Event()

    def drain_then_stop() -> None:
        if not engines.drain(config.shutdown_timeout):
            status.setdefault("code", EXIT_ENGINE_FAILED if engines.error else EXIT_DRAIN_TIMED_OUT)
            logger.warning("shutdown: requests still in flight after %.0f s were ended with an error",
                           config.shutdown_timeout)
        server.should_exit = True  # uvicorn stops accepting and closes connections once their responses end

    def stop(signum: int, frame: object) -> None:
        if stopping.is_set():  # a second signal: stop now
            server.force_exit = True
            return
        stopping.set()
        logger.info("Draining: up to %.0f s for the requests in flight", config.shutdown_timeout)
        threading.Thread(target=drain_then_stop, name="dabba-drain", daemon=True).start()

    def http() -> None:
        try:
            server.run()  # outside the main thread uvicorn installs no signal handlers: stop() does
        except SystemExit as e:  # uvicorn could not start (port taken): the process exits with its code
            status.setdefault("code", e.code if isinstance(e.code, int) else 1)
        finally:
            engines.shutdown()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    thread = threading.Thread(target=http, name="dabba-http")
    logger.info("Serving %s on http://%s:%d (OpenAI API under /v1)", what, host, port)
    thread.start()
    engines.run_loop()  # the engines step on the main thread (see AsyncLLMEngine)
    if engines.error is not None:  # the loop died: its streams have their errors; stop serving
        logger.error("the engine loop failed; the server exits with status %d", EXIT_ENGINE_FAILED)
        status.setdefault("code", EXIT_ENGINE_FAILED)
        server.should_exit = True
    thread.join()
    return status.get("code", 0)
