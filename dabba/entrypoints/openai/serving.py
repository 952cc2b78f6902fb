"""Between the OpenAI protocol and the engine: prompts, SamplingParams, responses and SSE
streams, shared by both endpoints, and /v1/completions (chat: serving_chat.py). Handlers stay
thin; nothing here touches tensors or the scheduler."""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from dabba.config import ServerConfig
from dabba.multimodal.fetch import UrlPolicy
from dabba.multimodal.media import ImageLimits, ImageSource
from dabba.engine.protocol import EngineClient, EngineDeadError, Overloaded, RequestStream
from dabba.entrypoints.openai.adapters import AdapterRegistry
from dabba.entrypoints.openai.errors import OpenAIError, param_of
from dabba.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                               CompletionResponse, ErrorInfo, ErrorResponse, PromptTokensDetails,
                                               SamplingFields, UsageInfo, random_id)
from dabba.entrypoints.openai.request_bounds import (check_bounds, check_constraint, constraint_field,
                                                     structured_outputs_of)
from dabba.lora_request import LoRARequest
from dabba.outputs import PositionLogprobs, RequestOutput
from dabba.sampling_params import RequestOutputKind, SamplingParams
from dabba.structured_output import StructuredOutputsParams
from dabba.structured_output.params import ThinkingSpan

logger = logging.getLogger("dabba")

# How often a non-streaming handler checks that its client is still there: a client that gave up
# stops its requests within this long (a streaming one stops at the next chunk it cannot send).
DISCONNECT_POLL_S = 0.05


@dataclass
class ChoiceProgress:
    """Streaming progress of one choice (prompt i, sample j), kept from its DELTA outputs."""

    num_chars: int = 0  # of its text so far
    num_tokens: int = 0
    # chat: tokens not sent yet (a chunk goes out with text or a finish reason), and their logprobs
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[PositionLogprobs] = field(default_factory=list)


class OpenAIServing:
    def __init__(self, client: EngineClient, served_model_name: str, config: ServerConfig | None = None,
                 adapters: AdapterRegistry | None = None) -> None:
        self.client = client
        self.served_model_name = served_model_name
        self.adapters = adapters or AdapterRegistry(client.model_info, served_model_name)
        self.config = config or ServerConfig()
        self.tokenizer = client.model_info.tokenizer
        self.max_model_len = client.model_info.max_model_len
        # where a request's images may come from (None: the model takes none)
        image_prompt = client.model_info.image_prompt
        self.image_source = ImageSource(ImageLimits(self.config.max_image_bytes, self.config.max_image_pixels),
                                        UrlPolicy(self.config.media_domains, self.config.media_fetch_timeout),
                                        image_prompt.check) if image_prompt is not None else None

    # ---- shared ---------------------------------------------------------------------------
    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names (None: the base model); a 404 for a name the server does not serve."""
        if model is None or model == self.served_model_name:
            return None
        lora = self.adapters.get(model)
        if lora is None:
            raise OpenAIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return lora

    def check_base_model(self, model: str | None) -> None:
        """check_model for what runs on the base model alone (embeddings, scores)."""
        if self.check_model(model) is not None:
            raise OpenAIError(400, f"`{model}` is a LoRA adapter; this endpoint runs the base model "
                                   f"`{self.served_model_name}` only", param="model")

    def model_name(self, model: str | None) -> str:
        """What a reply names as its model: the adapter asked for, else the base model."""
        return model if model is not None and self.adapters.get(model) is not None else self.served_model_name

    def sampling_params(self, req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None, structured: StructuredOutputsParams | None = None,
                        thinking: ThinkingSpan | None = None) -> SamplingParams:
        """A stream takes each step's news (DELTA); a single response takes the end (FINAL_ONLY)."""
        try:
            logit_bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
        except ValueError:
            raise OpenAIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
        optional = {name: getattr(req, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                    if getattr(req, name) is not None}
        try:
            return SamplingParams(
                n=req.n, max_tokens=max_tokens, stop=req.stop, seed=req.seed,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                logit_bias=logit_bias or None, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
                stop_token_ids=req.stop_token_ids or [], skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
                structured_outputs=structured, thinking=thinking, **optional,
            )
        except ValueError as e:
            raise OpenAIError(400, str(e), param=param_of(e)) from None

    async def _start(self, raw: Request, request_ids: list[str], prompts: list[Any], params: SamplingParams,
                     priority: int, constraint_param: str = "structured_outputs",
                     prompt_param: str = "prompt", lora: LoRARequest | None = None) -> list[RequestStream]:
        """Queue every prompt before answering: a rejected one is a 400 for the whole call,
        even when streaming, and leaves nothing running. The client processes each prompt off the
        event loop (tokenizing, validating and compiling its constraint, within the server's
        deadline); a bad constraint is a 400 naming ``constraint_param``, the request field it
        came from, a bad prompt ``prompt_param``; a full compile queue is a 503. A client that
        hangs up meanwhile stops waiting, and so the compile if nobody else waits for it."""
        check_constraint(params.structured_outputs, constraint_param, self.config)
        streams: list[RequestStream] = []
        timeout = self.config.structured_outputs_compile_timeout
        try:
            for request_id, prompt in zip(request_ids, prompts):
                adding = self.client.add_request(request_id, prompt, params, priority, compile_timeout=timeout,
                                                 lora_request=lora)
                # only a compile waits long enough for its client to leave meanwhile
                streams.append(await (adding if params.structured_outputs is None
                                      else self._unless_disconnected(raw, adding)))
        except BaseException as e:
            for stream in streams:
                stream.abort()
            if isinstance(e, ValueError):
                raise OpenAIError(400, str(e), param=param_of(e, prompt_param, constraint_param)) from None
            if isinstance(e, Overloaded):
                raise OpenAIError(503, str(e), type="server_error", code="overloaded") from None
            raise
        return streams

    @staticmethod
    def _check_failed(out: RequestOutput, constraint_param: str) -> None:
        """A request that ended with an error (its grammar reached a dead end) answers with it (an
        embedding never does: it comes only when its input went through)."""
        if not isinstance(out, RequestOutput):
            return
        for o in out.outputs:
            if o.finish_reason == "error":
                raise OpenAIError(400, o.error or "the request ended with an error", param=constraint_param)

    @staticmethod
    async def _unless_disconnected(raw: Request, awaitable: Any) -> Any:
        """``awaitable``'s result, or a 499 once the client has hung up (the awaitable is cancelled,
        its cleanup, such as releasing a compile, done; one that finished first still counts)."""
        task = asyncio.ensure_future(awaitable)
        while True:
            try:
                done, _ = await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
            except asyncio.CancelledError:  # the handler itself was cancelled
                task.cancel()
                raise
            if done:
                return task.result()
            if await raw.is_disconnected():
                task.cancel()
                try:
                    return await task
                except asyncio.CancelledError:
                    raise OpenAIError(499, "client disconnected") from None

    async def _finals(self, streams: list[RequestStream], raw: Request,
                      constraint_param: str = "structured_outputs") -> list[RequestOutput]:
        """Wait for every stream's (FINAL_ONLY) output; a client that hangs up aborts them all,
        one that ended with an error answers with it."""
        async def last(stream: RequestStream) -> RequestOutput:
            out = None
            async for out in stream:
                pass
            return out

        task = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
        while not task.done():
            done, _ = await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
            if not done and await raw.is_disconnected():
                # A cancelled gather ends with CancelledError as its exception (not as cancelled):
                # retrieved here, or asyncio logs "exception was never retrieved" per hang-up.
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
                task.cancel()
                for stream in streams:
                    stream.abort()
                raise OpenAIError(499, "client disconnected")
        outs = task.result()
        for out in outs:
            self._check_failed(out, constraint_param)
        return outs

    async def _merged(self, streams: list[RequestStream],
                      constraint_param: str = "structured_outputs") -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several prompts as they come, tagged with the prompt's index; one that
        ended with an error ends the stream with it (an error event)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for out in streams[i]:
                    await queue.put((i, out))
            except EngineDeadError as e:
                await queue.put((i, e))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    self._check_failed(item, constraint_param)
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            for stream in streams:  # leaving early (client gone) aborts every prompt's request
                stream.abort()

    def _streaming(self, events: AsyncIterator[dict]) -> StreamingResponse:
        """Every stream ends with [DONE]; one that fails says why in an error event first."""
        def event(body: dict) -> str:
            return f"data: {json.dumps(body)}\n\n"

        async def body() -> AsyncIterator[str]:
            try:
                async for item in events:
                    yield event(item)
            except OpenAIError as e:
                error = ErrorInfo(message=e.message, type=e.type, param=e.param, code=e.code)
                yield event(ErrorResponse(error=error).model_dump())
            except EngineDeadError as e:  # shut down mid-stream, or the engine failed (logged where it did)
                yield event(ErrorResponse(error=ErrorInfo(message=str(e), type="server_error", code=503)).model_dump())
            except Exception:  # a bug: say so without leaking internals
                logger.exception("stream failed")
                error = ErrorInfo(message="internal error while streaming", type="server_error")
                yield event(ErrorResponse(error=error).model_dump())
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ---- /v1/completions ------------------------------------------------------------------
    def _completion_prompts(self, req: CompletionRequest) -> list[Any]:
        p = req.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        if p and all(isinstance(x, str) for x in p):
            return list(p)
        if p and all(isinstance(x, list) for x in p):
            return [{"prompt_token_ids": x} for x in p]
        raise OpenAIError(400, "prompt must be a string, a list of strings, or token ids", param="prompt")

    async def completions(self, req: CompletionRequest, raw: Request):
        lora = self.check_model(req.model)
        check_bounds(req, self.config)
        if req.suffix is not None:
            raise OpenAIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError(400, "best_of is not supported (use n)", param="best_of")
        params = self.sampling_params(req, req.max_tokens if req.max_tokens is not None else 16, req.logprobs,
                                      req.logprobs if req.echo and req.logprobs is not None else None,
                                      structured_outputs_of(req))
        prompts = self._completion_prompts(req)
        base_id = random_id("cmpl")
        ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        streams = await self._start(raw, ids, prompts, params, req.priority, constraint_field(req), lora=lora)
        if req.stream:
            return self._streaming(self._completion_events(req, base_id, streams, params))
        outs = await self._finals(streams, raw, constraint_field(req))
        choices = []
        for i, out in enumerate(outs):
            for o in out.outputs:
                text, logprobs = o.text, None
                if req.echo:
                    text = self._prompt_text(out) + text
                if req.logprobs is not None:
                    logprobs = self._completion_logprobs(o.token_ids, o.logprobs, 0, out if req.echo else None)
                choices.append(CompletionChoice(index=i * params.n + o.index, text=text, logprobs=logprobs,
                                                finish_reason=o.finish_reason, stop_reason=o.stop_reason))
        return JSONResponse(CompletionResponse(id=base_id, model=self.model_name(req.model), choices=choices,
                                               usage=final_usage(outs)).model_dump())

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[PositionLogprobs] | None, text_offset: int,
                             echo: RequestOutput | None = None) -> CompletionLogprobs:
        """OpenAI's legacy shape for these output tokens, after the prompt's when echoing (``echo``
        is the output that carries the prompt); ``text_offset`` is where the first token's text
        starts in the choice's text."""
        lp = CompletionLogprobs()
        positions: list[tuple[int, PositionLogprobs | None]] = []
        if echo is not None:
            positions += list(zip(echo.prompt_token_ids, echo.prompt_logprobs or [None] * len(echo.prompt_token_ids)))
        positions += list(zip(token_ids, logprobs or []))
        offset = text_offset
        for token_id, position in positions:
            token = self._token_text(token_id)
            lp.tokens.append(token)
            lp.text_offset.append(offset)
            offset += len(token)
            if position is None:
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
                continue
            lp.token_logprobs.append(position[token_id].logprob)
            lp.top_logprobs.append({p.decoded_token: p.logprob for p in position.values()})
        return lp

    async def _completion_events(self, req: CompletionRequest, base_id: str, streams: list[RequestStream],
                                 params: SamplingParams) -> AsyncIterator[dict]:
        """One chunk per DELTA output of a choice (each holds at least one new token)."""
        prompts: dict[int, RequestOutput] = {}  # prompt index -> its first output, the one that carries the prompt
        progress: dict[int, ChoiceProgress] = {}
        async for i, out in self._merged(streams, constraint_field(req)):
            prompt = prompts.setdefault(i, out)
            for o in out.outputs:
                index = i * params.n + o.index
                state = progress.setdefault(index, ChoiceProgress())
                starting = state.num_tokens == 0
                text = self._prompt_text(prompt) + o.text if req.echo and starting else o.text
                logprobs = None
                if req.logprobs is not None:
                    offset = state.num_chars + (len(self._prompt_text(prompt)) if req.echo and not starting else 0)
                    logprobs = self._completion_logprobs(o.token_ids, o.logprobs, offset,
                                                         prompt if req.echo and starting else None)
                state.num_chars += len(o.text)
                state.num_tokens += len(o.token_ids)
                yield CompletionResponse(id=base_id, model=self.model_name(req.model), choices=[
                    CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=o.finish_reason,
                                     stop_reason=o.stop_reason)]).model_dump()
        if req.stream_options and req.stream_options.include_usage:
            num_prompt_tokens = sum(len(p.prompt_token_ids) for p in prompts.values())
            yield CompletionResponse(id=base_id, model=self.model_name(req.model), choices=[],
                                     usage=usage_info(num_prompt_tokens, sum(c.num_tokens for c in progress.values()),
                                                      sum(p.num_cached_tokens for p in prompts.values()))
                                     ).model_dump()


def usage_info(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                     total_tokens=num_prompt_tokens + num_completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens))


def final_usage(outs: list[RequestOutput]) -> UsageInfo:
    """Of cumulative (FINAL_ONLY) outputs: each prompt once, every sample's tokens."""
    return usage_info(sum(len(o.prompt_token_ids) for o in outs), sum(len(c.token_ids) for o in outs for c in o.outputs),
                      sum(o.num_cached_tokens for o in outs))
