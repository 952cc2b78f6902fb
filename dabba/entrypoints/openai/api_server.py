"""The FastAPI app: routes, API-key check, OpenAI-shaped errors, metrics, the browser pages
(entrypoints/web/); run_server.py runs it.

Handlers only convert between protocol types and engine types (see serving.py); they reach the
engines only through the client protocol (engine/protocol.py): one model's EngineClient, or a
router of several models.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import dabba
from dabba.config import ServerConfig
from dabba.engine.protocol import EngineClient, EngineDeadError, ModelRouterClient, ModelUnavailable
from dabba.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from dabba.entrypoints.openai.model_servings import ModelTable, OneModel, RoutedModels, ServingOptions, unavailable
from dabba.entrypoints.openai.protocol import (CacheReset, ChatCompletionRequest, CompletionRequest,
                                               DetokenizeRequest, LoadLoRAAdapterRequest, ModelOperation,
                                               TokenizeRequest, UnloadLoRAAdapterRequest)
from dabba.entrypoints.openai.errors import OpenAIError
from dabba.entrypoints.openai.response_store import ResponseStore
from dabba.entrypoints.openai.responses_protocol import ResponsesRequest
from dabba.entrypoints.openai.serving_responses import OpenAIServingResponses
from dabba.entrypoints.openai.serving_embedding import EmbeddingRequest
from dabba.entrypoints.openai.serving_score import RerankRequest, ScoreRequest
from dabba.entrypoints.web.routes import add_web_routes

if TYPE_CHECKING:
    from dabba.entrypoints.openai.run_server import Lifecycle

class BodyTooLarge(StarletteHTTPException):
    """Raised as a body's bytes pass the bound: an HTTPException, so FastAPI's body reading lets it
    through (it turns other errors there into a 400) to the app's handler."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes (the server's --max-request-body-bytes)")


class RequestBodyLimit:
    """A body past ``limit`` bytes is a 413 before it is read in full or parsed: at once when its
    Content-Length says so, else as soon as the bytes received pass it. Plain ASGI, not Starlette's
    BaseHTTPMiddleware, which would hide client disconnects from the handlers."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            response = OpenAIError(413, BodyTooLarge(self.limit).detail, code="request_too_large").response(
                scope["path"])
            return await response(scope, receive, send)
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, limited, send)


def build_app(client: EngineClient, served_model_name: str, api_key: str | None = None,
              tool_call_parser: str | None = None, config: ServerConfig | None = None,
              reasoning_parser: str | None = None, lora_modules: dict[str, str] | None = None) -> FastAPI:
    """The app in front of ``client`` (engine/clients.py makes one). ``tool_call_parser``: how
    tool_choice "auto" reads the model's calls (None: no auto tool choice); ``config``: the bounds
    on requests; ``reasoning_parser``: how a reply's thinking is split from its answer (None: it
    is not); ``lora_modules``: LoRA adapters served by name from the start ({name: path}; a bad
    one is a ValueError)."""
    config = config or ServerConfig()
    responses = OpenAIServingResponses(None, ResponseStore(config.max_stored_responses))
    table = OneModel(client, served_model_name, ServingOptions(tool_call_parser, reasoning_parser), config, responses)
    for name, path in (lora_modules or {}).items():
        table.servings.adapters.load(name, path)
    app = make_app(table, client, api_key, config)
    app.state.engine_client = client
    app.state.serving = table.servings.chat
    return app


def build_router_app(router: ModelRouterClient, options: dict[str, ServingOptions] | None = None,
                     api_key: str | None = None, config: ServerConfig | None = None,
                     lora_modules: dict[str, dict[str, str]] | None = None, keep_alive_period: float = 1.0) -> FastAPI:
    """The app in front of several models (engine/model_router.py): each request's ``model``
    routes it; ``options``: each model's reply parsers; ``lora_modules``: each model's adapters
    ({model: {name: path}}), served from its first load. Operators load and unload models with
    POST /models/load and /models/unload ({"model": name}), behind the API key."""
    config = config or ServerConfig()
    responses = OpenAIServingResponses(None, ResponseStore(config.max_stored_responses))
    table = RoutedModels(router, options or {}, config, responses, lora_modules)
    app = make_app(table, router, api_key, config, background=lambda: router.keep_alive_loop(keep_alive_period))
    app.state.router = router

    @app.post("/models/load", dependencies=[Depends(app.state.check_api_key)])
    async def load_model(req: ModelOperation):
        async with table.lease(req.model, req.keep_alive):  # as a request's first use loads it
            pass
        return {"model": req.model, "state": router.entries[req.model].state.value}

    @app.post("/models/unload", dependencies=[Depends(app.state.check_api_key)])
    async def unload_model(req: ModelOperation):
        try:
            await router.unload(req.model)  # its requests in flight finish first
        except ModelUnavailable as e:
            raise unavailable(e) from None
        return {"model": req.model, "state": router.entries[req.model].state.value}

    return app


def make_app(table: ModelTable, engines: Lifecycle, api_key: str | None, config: ServerConfig,
             background: Callable[[], Awaitable[None]] | None = None) -> FastAPI:
    """The routes, each reaching its model's servings through ``table``; ``engines``: what runs
    them (one EngineClient, or a router of several), stopped when the app stops; ``background``:
    a task for the app's life."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.ensure_future(background()) if background is not None else None
        yield
        if task is not None:
            task.cancel()
        engines.shutdown()  # uvicorn has stopped accepting and drained what it could

    # No redirects: Starlette's trailing-slash redirect builds its Location from the client's Host
    # header; such a path is a 404 like any other unknown one.
    app = FastAPI(title="dabba", version=dabba.__version__, lifespan=lifespan, redirect_slashes=False)
    app.add_middleware(RequestBodyLimit, limit=config.max_request_body_bytes)

    async def check_api_key(request: Request) -> None:
        # A dependency of the /v1 routes, not an HTTP middleware: Starlette's BaseHTTPMiddleware
        # hides client disconnects from the handlers, and those must abort requests.
        # The key as OpenAI's clients send it (Authorization: Bearer) or Anthropic's (x-api-key).
        if api_key is not None:
            bearer = hmac.compare_digest(request.headers.get("authorization", "").encode(),
                                         f"Bearer {api_key}".encode())  # constant time
            header = hmac.compare_digest(request.headers.get("x-api-key", "").encode(), api_key.encode())
            if not (bearer or header):
                raise OpenAIError(401, "Invalid or missing API key (send 'Authorization: Bearer <key>' or "
                                       "'x-api-key: <key>').", type="authentication_error", code="invalid_api_key")

    app.state.check_api_key = check_api_key
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)], redirect_slashes=False)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError):
        return e.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        # 400 with the first problem in words, never pydantic's trace
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":  # FastAPI's loc is ("body", character offset): no field to name
            offset = first.get("loc", ("body", "?"))[-1]
            reason = first.get("ctx", {}).get("error", "decode error")
            return OpenAIError(400, f"the body is not valid JSON: {reason} at character {offset}").response(
                request.url.path)
        if first.get("type") == "lone_surrogate":  # found by the body's walk: its place is in ctx
            path = first["ctx"]["path"]
            return OpenAIError(400, first["msg"], param=str(path[0]) if path else None).response(request.url.path)
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        return OpenAIError(400, f"{where}: {first.get('msg', 'invalid request')}", param=param).response(
            request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            return OpenAIError(404, f"Route {request.url.path} not found", code="not_found").response(request.url.path)
        if isinstance(e, BodyTooLarge):
            return OpenAIError(413, str(e.detail), code="request_too_large").response(request.url.path)
        return OpenAIError(e.status_code, str(e.detail)).response(request.url.path)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        # A bug: the client gets an error in the API's shape like every other (not Starlette's plain
        # text), without internals; Starlette re-raises it, so uvicorn logs its traceback.
        return OpenAIError(500, "internal server error", type="server_error").response(request.url.path)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, e: EngineDeadError):
        return OpenAIError(503, str(e), type="server_error").response(request.url.path)

    @app.get("/health")
    async def health():
        if not engines.is_running:
            return OpenAIError(503, "engine is not running", type="server_error").response()
        if engines.is_draining:  # so that a load balancer sends no more
            return OpenAIError(503, "the server is shutting down", type="server_error").response()
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": dabba.__version__}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": table.model_list()}

    # vLLM's runtime adapter endpoints, behind the API key
    @v1.post("/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        adapters = table.adapters(req.base_model_name)
        try:
            await asyncio.to_thread(adapters.load, req.lora_name, req.lora_path)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="lora_path" if "LoRA adapter" in str(e) else "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @v1.post("/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        try:
            table.adapters(req.base_model_name).unload(req.lora_name)
        except KeyError:
            raise OpenAIError(404, f"The LoRA adapter `{req.lora_name}` is not loaded.", param="lora_name",
                              code="model_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @v1.post("/completions")
    async def completions(req: CompletionRequest, raw: Request):
        async with table.lease(req.model, req.keep_alive) as s:
            return await s.chat.completions(req, raw)

    @v1.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        async with table.lease(req.model, req.keep_alive) as s:
            return await s.chat.chat(req, raw)

    @v1.post("/embeddings")
    async def embeddings(req: EmbeddingRequest, raw: Request):
        async with table.lease(req.model, req.keep_alive) as s:
            return await s.embedding.embeddings(req, raw)

    # vLLM's score, and rerank in the Jina/Cohere shape under the paths vLLM and llama.cpp answer
    # (the aliases share the handler, and stay out of the OpenAPI schema)
    @v1.post("/score")
    @app.post("/score", dependencies=[Depends(check_api_key)], include_in_schema=False)
    async def score(req: ScoreRequest, raw: Request):
        async with table.lease(req.model, req.keep_alive) as s:
            return await s.scoring.score(req, raw)

    @v1.post("/rerank")
    @app.post("/rerank", dependencies=[Depends(check_api_key)], include_in_schema=False)
    @app.post("/v2/rerank", dependencies=[Depends(check_api_key)], include_in_schema=False)
    async def rerank(req: RerankRequest, raw: Request):
        async with table.lease(req.model, req.keep_alive) as s:
            return await s.scoring.rerank(req, raw)

    @v1.post("/responses")
    async def create_response(req: ResponsesRequest, raw: Request):
        async with table.lease(req.model, req.keep_alive) as s:
            return await s.responses.create(req, raw)

    @v1.get("/responses/{response_id}")
    async def get_response(response_id: str):
        return table.responses.retrieve(response_id)

    @v1.delete("/responses/{response_id}")
    async def delete_response(response_id: str):
        return table.responses.delete(response_id)

    @v1.post("/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return table.responses.cancel(response_id)

    @v1.post("/messages")
    async def messages(req: MessagesRequest, raw: Request):
        async with table.lease(req.model, req.keep_alive) as s:
            return await s.anthropic.messages(req, raw)

    @v1.post("/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest):
        async with table.lease(req.model, req.keep_alive) as s:
            return await s.anthropic.count_tokens(req)

    app.include_router(v1)

    # vLLM's paths, outside /v1, behind the same key; the tokenizer runs off the event loop.
    @app.post("/tokenize", dependencies=[Depends(check_api_key)])
    async def tokenize(req: TokenizeRequest):
        async with table.lease(req.model, req.keep_alive) as s:
            s.chat.check_model(req.model)
            if (req.prompt is None) == (req.messages is None):
                raise OpenAIError(400, "give exactly one of prompt or messages", param="prompt")
            if req.messages is not None:
                prompt = await asyncio.to_thread(s.chat.chat_prompt, req.messages, req.add_generation_prompt,
                                                 req.tools, req.chat_template_kwargs)
                tokens = prompt["prompt_token_ids"]
            else:
                tokens = await asyncio.to_thread(s.client.model_info.tokenizer.encode, req.prompt,
                                                 add_special_tokens=req.add_special_tokens)
            return {"tokens": tokens, "count": len(tokens), "max_model_len": s.client.model_info.max_model_len}

    @app.post("/detokenize", dependencies=[Depends(check_api_key)])
    async def detokenize(req: DetokenizeRequest):
        async with table.lease(req.model, req.keep_alive) as s:
            s.chat.check_model(req.model)
            info = s.client.model_info
            bad = [t for t in req.tokens if not 0 <= t < info.vocab_size]
            if bad:
                raise OpenAIError(400, f"tokens outside [0, {info.vocab_size}): {bad[:5]}", param="tokens")
            text = await asyncio.to_thread(info.tokenizer.decode, req.tokens, skip_special_tokens=False)
            return {"prompt": text}

    @app.post("/cache/reset", dependencies=[Depends(check_api_key)])
    async def reset_cache(req: CacheReset | None = None):
        """Forget the cached prefixes, in the KV pool and the tiers under it, of one model or all."""
        return {"reset": await table.reset_cache(req.model if req else None)}

    @app.get("/server/limits", dependencies=[Depends(check_api_key)])
    async def server_limits():
        """The bounds this server holds requests and connections to, so that a client probing it
        (tools/reliability) knows them."""
        return dataclasses.asdict(config)

    add_web_routes(app, table, check_api_key)

    @app.get("/metrics")
    async def metrics():
        # the scheduler's gauges, computed when scraped
        return Response(await table.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    return app
