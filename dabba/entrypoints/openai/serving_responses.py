"""/v1/responses (OpenAI's Responses API): input items and instructions become a chat request
(one conversion; ``previous_response_id`` prepends a stored conversation), it runs on the chat
path (OpenAIServingChat.start_chat), and the reply's events (reply.py) become output items
(reasoning, message, function_call), whole or as the Responses event stream. Stored responses
(response_store.py) answer GET /v1/responses/{id}; an in-progress one can be cancelled."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from dabba.engine.protocol import EngineDeadError
from dabba.entrypoints.chat_utils import text_of
from dabba.entrypoints.openai.errors import OpenAIError
from dabba.entrypoints.openai.protocol import ChatCompletionRequest
from dabba.entrypoints.openai.responses_items import OutputItems, item_id
from dabba.entrypoints.openai.response_store import ResponseStore, StoredResponse
from dabba.entrypoints.openai.responses_protocol import ResponsesRequest
from dabba.entrypoints.openai.serving import DISCONNECT_POLL_S
from dabba.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from dabba.outputs import RequestOutput

logger = logging.getLogger("dabba")

END_OF_THINKING = "</think>"


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat | None, store: ResponseStore) -> None:
        self.chat = chat  # None: one that retrieves, deletes and cancels (the stored responses of every model)
        self.store = store
        self._cancel: dict[str, asyncio.Event] = {}  # in-progress responses' cancel signals

    def serving_for(self, chat: OpenAIServingChat) -> "OpenAIServingResponses":
        """The same stored responses and cancel signals, new ones answered by ``chat``'s model."""
        serving = OpenAIServingResponses(chat, self.store)
        serving._cancel = self._cancel
        return serving

    # ---- the one conversion -------------------------------------------------------------------
    def chat_request(self, req: ResponsesRequest) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
        """(the chat request that runs ``req``, the conversation to store: its messages without
        the instructions, which a continuation does not carry over, as OpenAI's does not)."""
        if req.background:
            raise OpenAIError(400, "background responses are not supported here (stream, or wait for the reply)",
                              param="background")
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                raise OpenAIError(404, f"No response found with id '{req.previous_response_id}' (never stored, or "
                                       f"evicted: the server keeps the last {self.store.capacity})",
                                  param="previous_response_id")
            history = list(previous.conversation)
        conversation = history + (input_messages(req.input) if isinstance(req.input, list)
                                  else [{"role": "user", "content": req.input}])
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
        body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream,
                                "parallel_tool_calls": req.parallel_tool_calls}
        for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                             ("top_k", "top_k")):
            if getattr(req, theirs) is not None:
                body[ours] = getattr(req, theirs)
        if req.tools:
            for j, tool in enumerate(req.tools):
                if tool.type != "function" or not tool.name:
                    raise OpenAIError(400, f"tools.{j}: only function tools (with a name) run here, not {tool.type!r}",
                                      param="tools")
            body["tools"] = [{"type": "function", "function": {k: v for k, v in (
                ("name", t.name), ("description", t.description), ("parameters", t.parameters),
                ("strict", t.strict)) if v is not None}} for t in req.tools]
        if req.tool_choice is not None:
            choice = req.tool_choice
            body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                          "function": {"name": choice.name}}
        form = req.text.format if req.text is not None else None
        if form is not None and form.type != "text":
            if form.type == "json_object":
                body["response_format"] = {"type": "json_object"}
            else:
                if form.json_schema is None:
                    raise OpenAIError(400, "text.format: a json_schema format needs its schema", param="text")
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": form.name or "output", "schema": form.json_schema,
                    **({"strict": form.strict} if form.strict is not None else {})}}
        if req.chat_template_kwargs:
            body["chat_template_kwargs"] = req.chat_template_kwargs
        if req.reasoning is not None and req.reasoning.effort is not None:
            body["reasoning_effort"] = req.reasoning.effort  # the chat path maps it to enable_thinking
        try:
            return ChatCompletionRequest.model_validate(body), conversation
        except ValueError as e:  # what the items held (a call's arguments that are no string, ...)
            raise OpenAIError(400, f"input: {e}", param="input") from None

    # ---- the endpoints ------------------------------------------------------------------------
    async def create(self, req: ResponsesRequest, raw: Request):
        chat_req, conversation = self.chat_request(req)
        response_id = item_id("resp")
        try:
            run = await self.chat.start_chat(chat_req, raw, response_id)
        except OpenAIError as e:  # the chat path's messages are this request's input
            if e.param is not None and e.param.startswith("messages"):
                e.param = "input"
            raise
        state = _ResponseState(self, req, run, conversation)
        cancelled = self._cancel[response_id] = asyncio.Event()
        if req.store:
            self.store.put(response_id, StoredResponse(state.body("in_progress"), conversation, run.streams))
        if req.stream:
            return StreamingResponse(self._events(state, cancelled), media_type="text/event-stream")
        try:
            async for _, out in _until(self.chat._merged(run.streams, run.constraint_param), cancelled, raw):
                state.take(out)
        finally:
            self._cancel.pop(response_id, None)
        return JSONResponse(state.finish(cancelled.is_set()))

    def retrieve(self, response_id: str) -> JSONResponse:
        return JSONResponse(self._stored(response_id).body)

    def delete(self, response_id: str) -> JSONResponse:
        """Forget a stored response (one in progress is cancelled first), as OpenAI's DELETE does."""
        stored = self._stored(response_id)
        if stored.body.get("status") == "in_progress" and response_id in self._cancel:
            self.cancel(response_id)
        self.store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    def cancel(self, response_id: str) -> JSONResponse:
        """Stop an in-progress response (its stream ends with it, status "cancelled")."""
        stored = self._stored(response_id)
        event = self._cancel.get(response_id)
        if event is None or stored.body.get("status") != "in_progress":
            raise OpenAIError(400, f"response '{response_id}' is {stored.body.get('status')}: only one in progress "
                                   "can be cancelled", param="response_id")
        stored.cancelled = True
        event.set()
        for stream in stored.streams:
            stream.abort()
        stored.body = {**stored.body, "status": "cancelled"}
        return JSONResponse(stored.body)

    def _stored(self, response_id: str) -> StoredResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise OpenAIError(404, f"No response found with id '{response_id}'", param="response_id")
        return stored

    async def _events(self, state: _ResponseState, cancelled: asyncio.Event) -> AsyncIterator[str]:
        """response.created, response.in_progress, then per output item: output_item.added, its
        content part (content_part.added/done), its deltas (reasoning_text, output_text,
        function_call_arguments) and their done, output_item.done; response.completed (or
        response.incomplete). A failure is an error event."""
        seq = 0

        def event(body: dict[str, Any]) -> str:
            nonlocal seq
            body = {**body, "sequence_number": seq}
            seq += 1
            return f"event: {body['type']}\ndata: {json.dumps(body)}\n\n"

        try:
            yield event({"type": "response.created", "response": state.body("in_progress")})
            yield event({"type": "response.in_progress", "response": state.body("in_progress")})
            async for _, out in _until(self.chat._merged(state.run.streams, state.run.constraint_param), cancelled):
                for body in state.take(out):
                    yield event(body)
            for body in state.items.close():
                yield event(body)
            final = state.finish(cancelled.is_set())
            kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
            yield event({"type": kind, "response": final})
        except OpenAIError as e:
            yield event({"type": "error", "code": e.code or e.type, "message": e.message, "param": e.param})
        except EngineDeadError as e:
            yield event({"type": "error", "code": "server_error", "message": str(e), "param": None})
        except Exception:  # a bug: say so without leaking internals
            logger.exception("stream failed")
            yield event({"type": "error", "code": "server_error", "message": "internal error while streaming",
                         "param": None})
        finally:
            self._cancel.pop(state.response_id, None)


class _ResponseState:
    """One response as it runs: its output items (built from the reply's events), tokens, and
    the Response object at any point."""

    def __init__(self, serving: OpenAIServingResponses, req: ResponsesRequest, run: ChatRun,
                 conversation: list[dict[str, Any]]) -> None:
        self.serving, self.req, self.run, self.conversation = serving, req, run, conversation
        self.response_id = run.request_id
        self.created_at = int(time.time())
        self.reader = run.form.reader()
        self.items = OutputItems()
        self.token_ids: list[int] = []
        self.num_cached = 0
        self.finish_reason: str | None = None

    def take(self, out: RequestOutput) -> list[dict[str, Any]]:
        """An engine output (DELTA when streaming, the one FINAL_ONLY otherwise): its events."""
        self.num_cached = out.num_cached_tokens
        o = out.outputs[0]
        self.token_ids += o.token_ids
        self.finish_reason = o.finish_reason or self.finish_reason
        return self.items.render(self.reader.feed(o.text, o.finish_reason is not None))

    def finish(self, cancelled: bool) -> dict[str, Any]:
        self.items.close()
        status = ("cancelled" if cancelled else "incomplete" if self.finish_reason == "length" else "completed")
        body = self.body(status)
        stored = self.serving.store.get(self.response_id) if self.req.store else None
        if stored is not None:
            stored.body, stored.streams = body, []
            stored.conversation = self.conversation + [self.items.as_message()]
        return body

    def body(self, status: str) -> dict[str, Any]:
        req = self.req
        form = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else \
            {"type": "text"}
        tool_choice = req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None else \
            req.tool_choice.model_dump()
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.serving.chat.served_model_name, "output": self.items.output() if status != "in_progress"
            else [], "instructions": req.instructions, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "max_output_tokens": req.max_output_tokens, "previous_response_id": req.previous_response_id,
            "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "text": {"format": form},
            "reasoning": req.reasoning.model_dump() if req.reasoning else None, "store": req.store,
            "metadata": req.metadata or {}, "user": req.user,
            "usage": self.usage() if status != "in_progress" else None,
        }

    def usage(self) -> dict[str, Any]:
        prompt, output = self.run.num_prompt_tokens, len(self.token_ids)
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": self.num_cached},
                "output_tokens": output, "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens()},
                "total_tokens": prompt + output}

    def _reasoning_tokens(self) -> int:
        """The reply's tokens up to the end of its thinking: to the closing tag's token where the
        vocabulary has one (Qwen3's, DeepSeek-R1's), else the thinking's text re-tokenized."""
        reasoning = self.items.reasoning_text
        if not reasoning:
            return 0
        tokenizer = self.serving.chat.tokenizer
        end = tokenizer.hf_tokenizer.token_to_id(END_OF_THINKING)
        if end is not None and end in self.token_ids:
            return self.token_ids.index(end) + 1
        if not self.items.has_answer:  # it never left its thinking
            return len(self.token_ids)
        return len(tokenizer.encode(reasoning, add_special_tokens=False))


def input_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: messages (text parts), an assistant's function_call items
    (its tool_calls) and reasoning items (its reasoning_content), function_call_output items (tool
    messages). Any other item is a 400 naming it."""
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None  # a reasoning item belongs to the assistant turn that follows it
    for i, item in enumerate(items):
        at = f"input.{i}"
        if not isinstance(item, dict):
            raise OpenAIError(400, f"{at}: an input item is an object", param="input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(400, f"{at}.role: one of user, system, developer, assistant, got {role!r}",
                                  param="input")
            message = {"role": "system" if role == "developer" else role,
                       "content": _message_content(item.get("content"), f"{at}.content")}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise OpenAIError(400, f"{at}: a function_call item needs call_id, name and arguments (strings)",
                                  param="input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
            if reasoning is not None:
                messages[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise OpenAIError(400, f"{at}: a function_call_output item needs its call_id", param="input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _parts_text(item.get("output"), f"{at}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise OpenAIError(400, f"{at}: a reasoning item's content is a list of text parts", param="input")
            reasoning = "".join(p["text"] for p in parts)
        else:
            raise OpenAIError(400, f"{at}: items of type {kind!r} are not supported here (message, function_call, "
                                   "function_call_output, reasoning)", param="input")
    return messages


def _message_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content for the chat path: text, or with input_image parts (an image_url: a
    data: URL, or an http(s) URL the server allows) chat content parts, text and image_url."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _parts_text(content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise OpenAIError(400, f"{where}.{j}: an input_image needs its image_url (a data: URL or an http(s) "
                                       "URL; file_id is not supported here)", param="input")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            parts.append({"type": "text", "text": _parts_text([part], f"{where}.{j}")})
    return parts


def _parts_text(content: Any, where: str) -> str:
    """A string, or input_text / output_text parts joined."""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else None
                raise OpenAIError(400, f"{where}.{j}: only text parts are supported (input_text, output_text), got "
                                       f"{kind!r}", param="input")
            parts.append({"type": "text", "text": part["text"]})
        content = parts
    try:
        return text_of(content, where)
    except ValueError as e:
        raise OpenAIError(400, str(e), param="input") from None


async def _until(outputs: AsyncIterator, cancelled: asyncio.Event,
                 raw: Request | None = None) -> AsyncIterator:
    """``outputs`` until ``cancelled`` is set (leaving them aborts their requests); with ``raw``,
    a client that hangs up meanwhile is a 499 (a non-streamed response's client: a stream's
    leaving closes the generator)."""
    iterator = outputs.__aiter__()
    waiter = asyncio.ensure_future(cancelled.wait())
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(iterator.__anext__())
            while True:
                done, _ = await asyncio.wait([step, waiter], timeout=DISCONNECT_POLL_S if raw else None,
                                             return_when=asyncio.FIRST_COMPLETED)
                if done:
                    break
                if raw is not None and await raw.is_disconnected():
                    raise OpenAIError(499, "client disconnected")
            if step not in done:  # cancelled
                return
            finished, step = step, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        waiter.cancel()
        if step is not None:  # leave the pending step first: the generator cannot close while it runs
            step.cancel()
            with contextlib.suppress(BaseException):
                await step
        await iterator.aclose()
