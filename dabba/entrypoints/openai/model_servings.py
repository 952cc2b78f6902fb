"""Which model's servings answer a request: the handlers of one model (built from its client's
ModelInfo: tokenizer, chat template, adapters), looked up by the request's ``model`` field.

A server of one model has one set, always there (OneModel). A server of several models
(RoutedModels) builds a set each time a model loads, and leases the model for the request's
handling: its ModelRouter (engine/model_router.py) loads it on first use and unloads it when idle.
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

from dabba.config import ServerConfig
from dabba.config_fields import parse_keep_alive
from dabba.engine.protocol import UNSET, EngineClient, ModelRouterClient, ModelState, ModelUnavailable, ServedModel
from dabba.entrypoints.anthropic.serving import AnthropicServing
from dabba.entrypoints.openai.adapters import AdapterRegistry
from dabba.entrypoints.openai.errors import OpenAIError
from dabba.entrypoints.openai.serving_chat import OpenAIServingChat
from dabba.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from dabba.entrypoints.openai.serving_responses import OpenAIServingResponses
from dabba.entrypoints.openai.serving_score import OpenAIServingScore


@dataclass(frozen=True)
class ServingOptions:
    """How a model's replies are read: tool calls and reasoning (per model: they follow its family)."""
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


@dataclass
class ModelServings:
    name: str
    client: EngineClient
    adapters: AdapterRegistry
    chat: OpenAIServingChat
    anthropic: AnthropicServing
    responses: OpenAIServingResponses
    embedding: OpenAIServingEmbedding
    scoring: OpenAIServingScore

    @classmethod
    def build(cls, client: EngineClient, name: str, options: ServingOptions, config: ServerConfig,
              responses: OpenAIServingResponses, adapters: AdapterRegistry) -> "ModelServings":
        chat = OpenAIServingChat(client, name, options.tool_call_parser, config, options.reasoning_parser, adapters)
        return cls(name, client, adapters, chat, AnthropicServing(chat), responses.serving_for(chat),
                   OpenAIServingEmbedding(client, name, config, adapters),
                   OpenAIServingScore(client, name, config, adapters))


class ModelTable(Protocol):
    """What the app asks of its models: every route reaches an engine through lease()."""

    responses: OpenAIServingResponses  # stored responses, whichever model wrote them

    def lease(self, model: str | None, keep_alive: object = None) -> contextlib.AbstractAsyncContextManager[
            ModelServings]: ...

    def adapters(self, base_model: str | None) -> AdapterRegistry: ...

    def model_list(self) -> list[dict]: ...

    def loaded(self) -> list[ModelServings]: ...

    async def render_metrics(self) -> bytes: ...

    async def reset_cache(self, model: str | None) -> list[str]:
        """Forget ``model``'s cached prefixes (None: every loaded model's); the names reset.
        A 409 while one of them runs requests."""
        ...


def model_card(name: str, max_model_len: int | None, **extra: object) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "dabba", "max_model_len": max_model_len, **extra}


class OneModel:
    """A server of one model: its servings answer every request; they 404 a name not theirs."""

    def __init__(self, client: EngineClient, name: str, options: ServingOptions, config: ServerConfig,
                 responses: OpenAIServingResponses) -> None:
        self.client, self.responses = client, responses
        self.servings = ModelServings.build(client, name, options, config, responses,
                                            AdapterRegistry(client.model_info, name))

    @contextlib.asynccontextmanager
    async def lease(self, model: str | None, keep_alive: object = None) -> AsyncIterator[ModelServings]:
        yield self.servings

    def adapters(self, base_model: str | None) -> AdapterRegistry:
        if base_model is not None and base_model != self.servings.name:
            raise OpenAIError(404, f"The model `{base_model}` does not exist.", param="base_model_name",
                              code="model_not_found")
        return self.servings.adapters

    def model_list(self) -> list[dict]:
        # the base model, then its adapters as vLLM lists them (parent: the base model, root: the files)
        s, max_len = self.servings, self.client.model_info.max_model_len
        return [model_card(s.name, max_len), *(model_card(lora.lora_name, max_len, parent=s.name, root=lora.lora_path)
                                               for lora in s.adapters.all())]

    def loaded(self) -> list[ModelServings]:
        return [self.servings]

    async def reset_cache(self, model: str | None) -> list[str]:
        self.servings.chat.check_model(model)
        return await reset_each([self.servings])

    async def render_metrics(self) -> bytes:
        return await self.client.render_metrics()


class RoutedModels:
    """A server of several models: each request leases its model from the router (which loads
    it if need be), and gets the servings built for the model's current load. An adapter's name
    routes to its base model."""

    def __init__(self, router: ModelRouterClient, options: dict[str, ServingOptions], config: ServerConfig,
                 responses: OpenAIServingResponses, lora_modules: dict[str, dict[str, str]] | None = None) -> None:
        self.router, self.options, self.config, self.responses = router, options, config, responses
        self._lora_modules = lora_modules or {}  # {model: {adapter: path}}, served from each model's first load
        self._servings: dict[str, ModelServings] = {}
        self._adapters: dict[str, AdapterRegistry] = {}

    def _base_of(self, model: str | None) -> str:
        if model is None:
            raise OpenAIError(400, f"model is required: this server serves {', '.join(sorted(self.router.entries))}",
                              param="model")
        if model in self.router.entries:
            return model
        for base, registry in self._adapters.items():
            if registry.get(model) is not None:
                return base
        for base, modules in self._lora_modules.items():  # served from the start: routed before the base loads
            if model in modules and base not in self._adapters:
                return base
        raise OpenAIError(404, f"The model `{model}` does not exist (served here: "
                               f"{', '.join(sorted(self.router.entries))}).", param="model", code="model_not_found")

    @contextlib.asynccontextmanager
    async def lease(self, model: str | None, keep_alive: object = None) -> AsyncIterator[ModelServings]:
        try:
            ka = UNSET if keep_alive is None else parse_keep_alive(keep_alive)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="keep_alive") from None
        try:
            entry = await self.router.acquire(self._base_of(model), ka)
        except ModelUnavailable as e:
            raise unavailable(e) from None
        try:
            yield await self._servings_of(entry)
        finally:
            self.router.release(entry)

    async def _servings_of(self, entry: ServedModel) -> ModelServings:
        servings = self._servings.get(entry.name)
        if servings is None or servings.client is not entry.client:
            registry = self._adapters.get(entry.name)
            if registry is None:
                registry = AdapterRegistry(entry.client.model_info, entry.name)
                for adapter, path in self._lora_modules.get(entry.name, {}).items():
                    await asyncio.to_thread(registry.load, adapter, path)
                self._adapters[entry.name] = registry
            servings = ModelServings.build(entry.client, entry.name, self.options.get(entry.name, ServingOptions()),
                                           self.config, self.responses, registry)
            self._servings[entry.name] = servings
        return servings

    def adapters(self, base_model: str | None) -> AdapterRegistry:
        if base_model is None:
            raise OpenAIError(400, "base_model_name is required: this server serves several models",
                              param="base_model_name")
        registry = self._adapters.get(base_model)
        if registry is None:
            if base_model not in self.router.entries:
                raise OpenAIError(404, f"The model `{base_model}` does not exist.", param="base_model_name",
                                  code="model_not_found")
            raise OpenAIError(400, f"the model `{base_model}` has not loaded yet: send it a request (or POST "
                                   "/models/load) first", param="base_model_name")
        return registry

    def model_list(self) -> list[dict]:
        cards = []
        for name, entry in self.router.entries.items():
            servings = self._servings.get(name) if entry.state is ModelState.LOADED else None
            max_len = servings.client.model_info.max_model_len if servings else None
            cards.append(model_card(name, max_len, state=entry.state.value, load_seconds=entry.load_seconds))
            registry = self._adapters.get(name)
            for lora in registry.all() if registry else []:
                cards.append(model_card(lora.lora_name, max_len, parent=name, root=lora.lora_path,
                                        state=entry.state.value))
        return cards

    def loaded(self) -> list[ModelServings]:
        return [s for name, s in self._servings.items()
                if self.router.entries[name].state is ModelState.LOADED and s.client is self.router.entries[name].client]

    async def render_metrics(self) -> bytes:
        return await self.router.render_metrics()

    async def reset_cache(self, model: str | None) -> list[str]:
        if model is not None:
            self._base_of(model)  # a 404 for a name not served
        return await reset_each([s for s in self.loaded() if model is None or s.name == self._base_of(model)])


async def reset_each(servings: list[ModelServings]) -> list[str]:
    busy = [s.name for s in servings if not await s.client.reset_cache()]
    if busy:
        raise OpenAIError(409, f"requests are running on {', '.join(busy)}: their cached prefixes stay; retry when "
                               "they have finished", code="cache_in_use")
    return [s.name for s in servings]


def unavailable(e: ModelUnavailable) -> OpenAIError:
    """The router's refusal in the API's shape: 503s carry Retry-After."""
    code = {404: "model_not_found", 503: "model_unavailable", 507: "insufficient_memory"}.get(e.status)
    return OpenAIError(e.status, e.message, type="invalid_request_error" if e.status == 404 else "server_error",
                       param="model" if e.status == 404 else None, code=code,
                       headers=None if e.retry_after is None else {"Retry-After": str(int(e.retry_after))})
