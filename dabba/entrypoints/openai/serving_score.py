"""POST /v1/score (vLLM's: text_1 against text_2) and /v1/rerank (the Jina/Cohere shape vLLM and
llama.cpp answer: a query, documents, top_n, return_documents), on a cross-encoder or an embedding
model (entrypoints/scoring.py says how each scores a pair)."""
from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import Request
from pydantic import Field

from dabba.engine.protocol import RequestStream
from dabba.entrypoints.openai.errors import OpenAIError
from dabba.entrypoints.openai.protocol import OpenAIModel, OpenAIRequest, random_id
from dabba.entrypoints.openai.serving import OpenAIServing
from dabba.entrypoints.scoring import ScoringPlan, pair_up, plan_scoring
from dabba.errors import InvalidRequest
from dabba.pooling_params import PoolingParams

MAX_SCORED_PAIRS = 1024  # one request's pairs (documents)


class ScoreRequest(OpenAIRequest):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    instruction: str | None = None  # a reranker with a judging prompt (Qwen3-Reranker): what it judges by


class RerankDocument(OpenAIModel):
    text: str


class RerankRequest(OpenAIRequest):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    instruction: str | None = None


class OpenAIServingScore(OpenAIServing):
    async def _scores(self, pairs: list[tuple[str, str]], truncate: int | None, instruction: str | None,
                      raw: Request, field_of_texts: str) -> tuple[list[float], int]:
        """Each pair's score and the tokens read, or a 400 naming ``field_of_texts`` for a bad text."""
        if len(pairs) > MAX_SCORED_PAIRS:
            raise OpenAIError(400, f"{len(pairs)} pairs to score; at most {MAX_SCORED_PAIRS} per request",
                              param=field_of_texts)
        info = self.client.model_info
        try:  # a cross-encoder tokenizes up to MAX_SCORED_PAIRS pairs: off the event loop, as prompts are
            plan: ScoringPlan = await asyncio.to_thread(plan_scoring, info, pairs, instruction)
            params = PoolingParams(truncate_prompt_tokens=truncate)
        except InvalidRequest as e:
            own = ("text_1", "text_2", "truncate_prompt_tokens", "instruction")  # fields the error names itself
            raise OpenAIError(400, str(e), param=e.param if e.param in own
                              else ("model" if e.param is None else field_of_texts)) from None
        request_id = random_id("score")
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(plan.prompts):
                streams.append(await self.client.add_request(f"{request_id}-{i}", prompt, params))
        except BaseException as e:
            for stream in streams:
                stream.abort()
            if isinstance(e, ValueError):
                param = getattr(e, "param", None)
                raise OpenAIError(400, str(e), param="truncate_prompt_tokens" if param == "truncate_prompt_tokens"
                                  else field_of_texts) from None
            raise
        outs = await self._finals(streams, raw)
        return plan.scores([o.outputs.embedding for o in outs]), sum(len(o.prompt_token_ids) for o in outs)

    async def score(self, req: ScoreRequest, raw: Request) -> dict[str, Any]:
        self.check_base_model(req.model)
        try:
            pairs = pair_up(req.text_1, req.text_2)
        except InvalidRequest as e:
            raise OpenAIError(400, str(e), param=e.param) from None
        scores, num_tokens = await self._scores(pairs, req.truncate_prompt_tokens, req.instruction, raw, "text_2")
        return {"id": random_id("score"), "object": "list", "created": int(time.time()),
                "model": self.served_model_name,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    async def rerank(self, req: RerankRequest, raw: Request) -> dict[str, Any]:
        self.check_base_model(req.model)
        texts = [d if isinstance(d, str) else d.text for d in req.documents]
        if not texts:
            return {"id": random_id("rerank"), "model": self.served_model_name, "usage": {"total_tokens": 0},
                    "results": []}
        scores, num_tokens = await self._scores([(req.query, t) for t in texts], req.truncate_prompt_tokens,
                                                req.instruction, raw, "documents")
        order = sorted(range(len(texts)), key=lambda i: -scores[i])[:req.top_n or None]  # 0: all, as vLLM
        results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": texts[i]}}
                                                                 if req.return_documents else {})} for i in order]
        return {"id": random_id("rerank"), "model": self.served_model_name, "usage": {"total_tokens": num_tokens},
                "results": results}
