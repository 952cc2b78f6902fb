"""The FastAPI app: routes, API-key check, OpenAI-shaped errors, metrics; and running it.

Handlers only convert between protocol types and engine types (see serving.py); the engine
loop runs on one thread of its own (AsyncLLMEngine), which serve() makes the main thread.
"""
from __future__ import annotations

import contextlib
import hmac
import logging
import signal
import threading
from typing import AsyncIterator

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import dabba
from dabba.engine.async_engine import AsyncLLMEngine, EngineDeadError
from dabba.engine.llm_engine import LLMEngine
from dabba.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                               TokenizeRequest)
from dabba.entrypoints.openai.serving import OpenAIError
from dabba.entrypoints.openai.serving_chat import OpenAIServingChat

logger = logging.getLogger("dabba")


def build_app(engine: LLMEngine, served_model_name: str, api_key: str | None = None,
              engine_thread: bool = True, tool_call_parser: str | None = None) -> FastAPI:
    """The app; its engine loop runs in a thread of its own, or (``engine_thread=False``) wherever
    the caller runs ``app.state.engine.run_loop()``. ``tool_call_parser``: how tool_choice "auto"
    reads the model's calls (None: no auto tool choice)."""
    async_engine = AsyncLLMEngine(engine, served_model_name, start_thread=engine_thread)
    serving = OpenAIServingChat(async_engine, served_model_name, tool_call_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        async_engine.shutdown()  # uvicorn has stopped accepting and drained what it could

    app = FastAPI(title="dabba", version=dabba.__version__, lifespan=lifespan)
    app.state.engine = async_engine
    app.state.serving = serving

    async def check_api_key(request: Request) -> None:
        # A dependency of the /v1 routes, not an HTTP middleware: Starlette's BaseHTTPMiddleware
        # hides client disconnects from the handlers, and those must abort requests.
        if api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):  # constant time
                raise OpenAIError(401, "Invalid or missing API key (send 'Authorization: Bearer <key>').",
                                  type="authentication_error", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, e: OpenAIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        # 400 with the first problem in words, never pydantic's trace
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        return OpenAIError(400, f"{where}: {first.get('msg', 'invalid request')}", param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            return OpenAIError(404, f"Route {request.url.path} not found", code="not_found").response()
        return OpenAIError(e.status_code, str(e.detail)).response()

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError):
        return OpenAIError(503, str(e), type="server_error").response()

    @app.get("/health")
    async def health():
        if not async_engine.is_running:
            return OpenAIError(503, "engine is not running", type="server_error").response()
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": dabba.__version__}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": 0,
                                            "owned_by": "dabba", "max_model_len": engine.max_model_len}]}

    @v1.post("/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.completions(req, raw)

    @v1.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    app.include_router(v1)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            tokens = serving.chat_prompt(req.messages, req.add_generation_prompt, req.tools)["prompt_token_ids"]
        else:
            tokens = engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < engine.arch.vocab_size]
        if bad:
            raise OpenAIError(400, f"tokens outside [0, {engine.arch.vocab_size}): {bad[:5]}", param="tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/metrics")
    async def metrics():
        async_engine.metrics.observe_scheduler(await async_engine.get_stats())  # computed when scraped
        return Response(generate_latest(async_engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(engine: LLMEngine, served_model_name: str, host: str, port: int, api_key: str | None,
          tool_call_parser: str | None = None) -> None:
    """Run until SIGINT/SIGTERM: uvicorn stops accepting, lets in-flight requests finish (up to
    30 s), then the engine aborts what is left and stops."""
    app = build_app(engine, served_model_name, api_key, engine_thread=False, tool_call_parser=tool_call_parser)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=30))

    def stop(signum: int, frame: object) -> None:  # uvicorn drains, then its lifespan stops the engine loop
        server.should_exit = True

    exit_code = []

    def http() -> None:
        try:
            server.run()  # outside the main thread uvicorn installs no signal handlers: stop() does
        except SystemExit as e:  # uvicorn could not start (port taken): the process exits with its code
            exit_code.append(e.code)
        finally:
            app.state.engine.shutdown()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    thread = threading.Thread(target=http, name="dabba-http")
    logger.info("Serving %s on http://%s:%d (OpenAI API under /v1)", served_model_name, host, port)
    thread.start()
    app.state.engine.run_loop()  # the engine steps on the main thread (see AsyncLLMEngine)
    thread.join()
    if exit_code:
        raise SystemExit(exit_code[0])
