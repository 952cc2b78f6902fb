"""POST /v1/embeddings as OpenAI's: input a string, a list of strings, one token-id list or a list of
them; ``encoding_format`` float or base64 (little-endian float32, as OpenAI's clients decode it);
``dimensions`` (Matryoshka models); usage. Every input is a pooling request of its own, batched by
the scheduler with whatever else runs."""
from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from fastapi import Request
from pydantic import Field

from dabba.engine.protocol import RequestStream
from dabba.entrypoints.openai.errors import OpenAIError
from dabba.errors import InvalidRequest
from dabba.entrypoints.openai.protocol import OpenAIRequest, random_id
from dabba.entrypoints.openai.serving import OpenAIServing
from dabba.pooling_params import PoolingParams

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on one request's inputs


class EmbeddingRequest(OpenAIRequest):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # vLLM's extensions
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    normalize: bool | None = None


class OpenAIServingEmbedding(OpenAIServing):
    """Answers 400 when the model does not pool (ModelInfo.pooler is None)."""

    def _inputs(self, req: EmbeddingRequest) -> list[Any]:
        value = req.input
        if isinstance(value, str):
            inputs: list[Any] = [value]
        elif value and all(isinstance(x, int) for x in value):
            inputs = [{"prompt_token_ids": list(value)}]
        elif value and all(isinstance(x, str) for x in value):
            inputs = list(value)
        elif value and all(isinstance(x, list) for x in value):
            inputs = [{"prompt_token_ids": list(x)} for x in value]
        else:
            raise OpenAIError(400, "input must be a non-empty string, list of strings, list of token ids or list of "
                                   "token-id lists", param="input")
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise OpenAIError(400, f"input holds {len(inputs)} inputs; at most {MAX_EMBEDDING_INPUTS} per request",
                              param="input")
        for i, item in enumerate(inputs):
            if item == "" or item == {"prompt_token_ids": []}:
                raise OpenAIError(400, f"input[{i}] is empty", param="input")
        return inputs

    async def embeddings(self, req: EmbeddingRequest, raw: Request) -> dict[str, Any]:
        self.check_base_model(req.model)
        if self.client.model_info.pooler is None:
            raise OpenAIError(400, f"this model ({self.client.model_info.architecture}) does not produce embeddings",
                              param="model")
        inputs = self._inputs(req)
        try:
            params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize,
                                   truncate_prompt_tokens=req.truncate_prompt_tokens)
        except ValueError as e:
            raise OpenAIError(400, str(e), param=_param(e)) from None
        request_id = random_id("embd")
        streams: list[RequestStream] = []
        try:
            for i, item in enumerate(inputs):
                streams.append(await self.client.add_request(f"{request_id}-{i}", item, params))
        except BaseException as e:
            for stream in streams:
                stream.abort()
            if isinstance(e, ValueError):
                raise OpenAIError(400, str(e), param=_param(e)) from None
            raise
        outs = await self._finals(streams, raw)
        data = [{"object": "embedding", "index": i,
                 "embedding": _base64(o.outputs.embedding) if req.encoding_format == "base64" else o.outputs.embedding}
                for i, o in enumerate(outs)]
        num_tokens = sum(len(o.prompt_token_ids) for o in outs)
        return {"object": "list", "data": data, "model": self.served_model_name,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def _param(error: ValueError) -> str | None:
    """The request field an engine's InvalidRequest names (a prompt's is the input's)."""
    param = error.param if isinstance(error, InvalidRequest) else None
    if param in ("prompt", "prompt_token_ids"):
        return "input"
    return param if param in EmbeddingRequest.model_fields else None


def _base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
