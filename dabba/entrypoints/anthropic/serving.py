"""/v1/messages and /v1/messages/count_tokens: an Anthropic request becomes a chat completions
request (one conversion), runs on the chat path (OpenAIServingChat.start_chat: template,
sampling, tools and their constraint), and its reply's events (openai/reply.py) are rendered as
content blocks: thinking, text and tool_use, whole or as Anthropic's stream of events."""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from dabba.engine.protocol import EngineDeadError
from dabba.entrypoints.anthropic.errors import error_body
from dabba.entrypoints.anthropic.protocol import CountTokensRequest, MessageResponse, MessagesRequest, Usage
from dabba.entrypoints.chat_utils import text_of
from dabba.entrypoints.openai.errors import OpenAIError
from dabba.entrypoints.openai.protocol import ChatCompletionRequest
from dabba.entrypoints.openai.reply import CallArguments, CallOpened, Text, Thinking
from dabba.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from dabba.outputs import CompletionOutput

logger = logging.getLogger("dabba")

# Anthropic's floor on an enabled thinking budget; below it (or at max_tokens or past it) is a 400.
MIN_THINKING_BUDGET = 1024
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # what an image block's base64 may hold


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


class AnthropicServing:
    """The Messages API over the chat path of ``chat`` (the OpenAI server's)."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    # ---- the one conversion -------------------------------------------------------------------
    def chat_request(self, req: CountTokensRequest) -> ChatCompletionRequest:
        """The chat completions request that runs ``req``: system and messages (text, tool_use,
        tool_result and thinking blocks) as chat messages, tools as functions, tool_choice,
        thinking as the template's enable_thinking, sampling fields by their OpenAI names."""
        messages: list[dict[str, Any]] = []
        if req.system is not None:
            messages.append({"role": "system", "content": _text(req.system, "system")})
        for i, m in enumerate(req.messages):
            messages += _chat_messages(m.role, m.content, f"messages.{i}.content")
        body: dict[str, Any] = {"model": req.model, "messages": messages}
        if req.messages and req.messages[-1].role == "assistant":  # a prefill: the reply continues it
            body["continue_final_message"], body["add_generation_prompt"] = True, False
        if req.tools:
            for j, tool in enumerate(req.tools):
                if tool.type not in (None, "custom"):
                    raise OpenAIError(400, f"tools.{j}: server tool {tool.type!r} is not available here (only "
                                           "custom tools, which the client runs)", param="tools")
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, **({"description": t.description} if t.description is not None else {}),
                "parameters": t.input_schema}} for t in req.tools]
        if req.tool_choice is not None:
            choice = req.tool_choice
            if choice.type == "tool":
                if not choice.name:
                    raise OpenAIError(400, 'tool_choice: type "tool" needs the tool\'s name', param="tool_choice")
                body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        if req.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
        if isinstance(req, MessagesRequest):
            if req.max_tokens < 1:
                raise OpenAIError(400, f"max_tokens: must be at least 1, got {req.max_tokens}", param="max_tokens")
            budget = req.thinking.budget_tokens if req.thinking is not None else None
            if req.thinking is not None and req.thinking.type == "enabled" and (
                    budget is None or not MIN_THINKING_BUDGET <= budget < req.max_tokens):
                raise OpenAIError(400, f"thinking.budget_tokens: must be at least {MIN_THINKING_BUDGET} and less than "
                                       f"max_tokens ({req.max_tokens}), got {budget}", param="thinking")
            body.update(max_tokens=req.max_tokens, stream=req.stream)
            if req.thinking is not None and req.thinking.type == "enabled":
                body["max_thinking_tokens"] = budget  # enforced where the server splits thinking
            for ours, theirs in (("stop", "stop_sequences"), ("temperature", "temperature"), ("top_p", "top_p"),
                                 ("top_k", "top_k")):
                if getattr(req, theirs) is not None:
                    body[ours] = getattr(req, theirs)
            if req.output_config is not None and req.output_config.format is not None:
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "output", "schema": req.output_config.format.json_schema}}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValueError as e:  # pydantic's, on what the blocks held (a tool_use input that is no object, ...)
            raise OpenAIError(400, f"invalid request: {e}") from None

    # ---- the endpoints ------------------------------------------------------------------------
    async def count_tokens(self, req: CountTokensRequest) -> JSONResponse:
        chat_req = self.chat_request(req)
        self.chat.check_model(chat_req.model)
        prompt = await asyncio.to_thread(self.chat.chat_prompt, chat_req.messages, chat_req.add_generation_prompt,
                                         chat_req.tools, chat_req.chat_template_kwargs, chat_req.continue_final_message)
        return JSONResponse({"input_tokens": len(prompt["prompt_token_ids"])})

    async def messages(self, req: MessagesRequest, raw: Request):
        run = await self.chat.start_chat(self.chat_request(req), raw, message_id())
        if req.stream:
            return StreamingResponse(self._events(run), media_type="text/event-stream")
        (out,) = await self.chat._finals(run.streams, raw, run.constraint_param)
        o = out.outputs[0]
        reply = run.form.reader().read(o.text)
        content: list[dict[str, Any]] = []
        if reply.reasoning:
            content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
        if reply.content:
            content.append({"type": "text", "text": reply.content})
        content += [_tool_use(call.id, call.name, call.arguments) for call in reply.calls]
        stop_reason, stop_sequence = _stop(o, bool(reply.calls))
        usage = Usage(input_tokens=len(out.prompt_token_ids), output_tokens=len(o.token_ids),
                      cache_read_input_tokens=out.num_cached_tokens)
        return JSONResponse(MessageResponse(id=run.request_id, model=run.model, content=content,
                                            stop_reason=stop_reason, stop_sequence=stop_sequence,
                                            usage=usage).model_dump())

    async def _events(self, run: ChatRun) -> AsyncIterator[str]:
        """message_start, ping, each content block's start, deltas and stop (thinking_delta,
        text_delta, input_json_delta), message_delta with the stop reason and usage, message_stop;
        an error event if the run fails."""
        def event(body: dict[str, Any]) -> str:
            return f"event: {body['type']}\ndata: {json.dumps(body)}\n\n"

        blocks = _Blocks()
        reader = run.form.reader()
        num_tokens, cached = 0, 0
        yield event({"type": "message_start", "message": MessageResponse(
            id=run.request_id, model=run.model, content=[],
            usage=Usage(input_tokens=run.num_prompt_tokens, output_tokens=0)).model_dump()})
        yield event({"type": "ping"})
        try:
            async for _, out in self.chat._merged(run.streams, run.constraint_param):
                cached = out.num_cached_tokens
                o = out.outputs[0]
                num_tokens += len(o.token_ids)
                for body in blocks.render(reader.feed(o.text, o.finish_reason is not None)):
                    yield event(body)
                if o.finish_reason is not None:
                    for body in blocks.close():
                        yield event(body)
                    stop_reason, stop_sequence = _stop(o, reader.num_calls > 0)
                    yield event({"type": "message_delta", "delta": {"stop_reason": stop_reason,
                                                                    "stop_sequence": stop_sequence},
                                 "usage": {"output_tokens": num_tokens, "input_tokens": run.num_prompt_tokens,
                                           "cache_read_input_tokens": cached}})
                    yield event({"type": "message_stop"})
        except OpenAIError as e:
            yield event(error_body(e.status, e.message))
        except EngineDeadError as e:
            yield event(error_body(529, str(e)))
        except Exception:  # a bug: say so without leaking internals
            logger.exception("stream failed")
            yield event(error_body(500, "internal error while streaming"))


class _Blocks:
    """The content blocks a streamed reply has opened: an event opens a block of its kind where
    the open one is another (a call always opens its own)."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def render(self, events: list) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, Thinking):
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": e.text}))
            elif isinstance(e, Text):
                out += self._open("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": e.text}))
            elif isinstance(e, CallOpened):
                out += self.close()
                out += self._open("tool_use", {"type": "tool_use", "id": e.call.id, "name": e.call.name, "input": {}})
            elif isinstance(e, CallArguments) and e.text:
                out.append(self._delta({"type": "input_json_delta", "partial_json": e.text}))
        return out

    def close(self) -> list[dict[str, Any]]:
        if self.kind is None:
            return []
        self.kind = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _open(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        if self.kind == kind:
            return []
        out = self.close()
        self.index, self.kind = self.index + 1, kind
        return out + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}


def _text(content: Any, where: str) -> str:
    """A string, or text blocks ({"type": "text", "text": ...}) joined."""
    try:
        return text_of(content, where)
    except ValueError as e:
        raise OpenAIError(400, str(e), param=where.split(".")[0]) from None


def _chat_messages(role: str, content: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool_result blocks become tool messages
    (before its text), an assistant's tool_use blocks its tool_calls and its thinking blocks its
    reasoning_content."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    texts, calls, thinking, results, parts = [], [], [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.{j}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), f"{at}.source")}})
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input"), dict):
                raise OpenAIError(400, f"{at}: a tool_use block needs an id, a name and an input object",
                                  param="messages")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise OpenAIError(400, f"{at}: a tool_result block needs its tool_use_id", param="messages")
            result = _text(block.get("content"), f"{at}.content")
            if block.get("is_error") is True:
                result = f"Error: {result}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # opaque to anyone but its writer
        else:
            raise OpenAIError(400, f"{at}: a {kind!r} block is not supported in a {role} message here (text, "
                                   "tool_use and thinking from the assistant, text and tool_result from the user)",
                              param="messages")
    if role == "user":
        has_images = any(p["type"] == "image_url" for p in parts)
        text = parts if has_images else "".join(texts)
        return results + ([{"role": "user", "content": text}] if parts or not results else [])
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return [message]


def _image_url(source: Any, where: str) -> str:
    """An image block's source as the chat path's image URL: base64 data (a data: URL of its
    media_type) or a url."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and source.get("media_type") in IMAGE_MEDIA_TYPES:
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise OpenAIError(400, f"{where}: an image source is {{\"type\": \"base64\", \"media_type\": one of "
                           f"{', '.join(IMAGE_MEDIA_TYPES)}, \"data\": ...}} or {{\"type\": \"url\", \"url\": ...}}",
                      param="messages")


def _tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:  # a call cut off by max_tokens
        value = None
    return {"type": "tool_use", "id": call_id, "name": name, "input": value if isinstance(value, dict) else {}}


def _stop(o: CompletionOutput, has_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): end_turn, max_tokens, stop_sequence (with the one that
    matched) or tool_use."""
    if o.finish_reason == "length":
        return "max_tokens", None
    if isinstance(o.stop_reason, str):
        return "stop_sequence", o.stop_reason
    return ("tool_use" if has_calls else "end_turn"), None
