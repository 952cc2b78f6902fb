"""/v1/chat/completions: the chat template (with tools and tool messages), sampling params (a
tool_choice that forces calls constrains the output), and replies whose text the tool-call
reading (tool_calls.py) turns into ``message.tool_calls``, streamed or not."""
from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from dabba.config import ServerConfig
from dabba.engine.protocol import EngineClient, RequestStream
from dabba.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                               ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatMessage,
                                               ChatMessageOut, ChatStreamChoice, ChatTool, DeltaFunctionCall,
                                               DeltaToolCall, FunctionCall, TokenLogprob, ToolCallOut, TopLogprob,
                                               UsageInfo, random_id)
from dabba.entrypoints.openai.adapters import AdapterRegistry
from dabba.entrypoints.openai.errors import OpenAIError
from dabba.entrypoints.openai.request_bounds import check_bounds, constraint_field, structured_outputs_of
from dabba.entrypoints.openai.serving import ChoiceProgress, OpenAIServing, final_usage, usage_info
from dabba.entrypoints.chat_utils import render_conversation, template_content, text_of
from dabba.entrypoints.openai.reasoning import END, REASONING_PARSERS, START
from dabba.entrypoints.openai.reply import CallOpened, ReplyFormat, Text, Thinking
from dabba.entrypoints.openai.tool_call_parsers import TOOL_CALL_PARSERS
from dabba.entrypoints.openai.tool_calls import ToolCall, named_schema, required_schema
from dabba.outputs import PositionLogprobs, RequestOutput
from dabba.sampling_params import SamplingParams
from dabba.structured_output import StructuredOutputsParams
from dabba.structured_output.params import ThinkingSpan


@dataclass
class ChatRun:
    """A chat request queued in the engine: its streams (one), how its replies are read, and the
    prompt's length (known before the first output)."""

    request_id: str
    streams: list[RequestStream]
    params: SamplingParams
    form: ReplyFormat
    constraint_param: str
    num_prompt_tokens: int
    model: str  # what its replies name as the model: the adapter asked for, else the base model


class OpenAIServingChat(OpenAIServing):
    """Completions (the base class) and chat. ``tool_call_parser``: how "auto" tool choice reads
    the model's calls (``--enable-auto-tool-choice --tool-call-parser NAME``); None: no auto."""

    def __init__(self, client: EngineClient, served_model_name: str, tool_call_parser: str | None = None,
                 config: ServerConfig | None = None, reasoning_parser: str | None = None,
                 adapters: AdapterRegistry | None = None) -> None:
        super().__init__(client, served_model_name, config, adapters)
        if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {tool_call_parser!r}")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {reasoning_parser!r}")
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.thinking_span = thinking_span(self.tokenizer, reasoning_parser)

    def reply_format(self, tool_choice: Any, tools: list[ChatTool] | None, constrained: bool,
                     parallel_tool_calls: bool = True) -> ReplyFormat:
        """How this server reads a request's replies (reply.py): every chat API's one reading.
        ``constrained``: a grammar holds the reply from its first token (it cannot think)."""
        functions = {t.function.name: t.function.parameters or {} for t in tools or []}
        return ReplyFormat(tool_choice, self.tool_call_parser if tools else None, self.reasoning_parser,
                           constrained, parallel_tool_calls, functions)

    # ---- the prompt ---------------------------------------------------------------------------
    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    tools: list[ChatTool] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                    continue_final_message: bool = False) -> dict:
        """The template renders the conversation (and ``tools``, as Hugging Face templates take
        them); an assistant's tool calls reach it with their arguments as objects, as
        transformers passes them, and its earlier thinking as ``reasoning_content``.
        ``continue_final_message``: the last message is the start of the reply (an assistant's
        prefill): the conversation before it, the generation prompt, then its text."""
        if continue_final_message:
            if add_generation_prompt or not messages or messages[-1].role != "assistant":
                raise OpenAIError(400, "continue_final_message needs add_generation_prompt=false and an assistant "
                                       "message last", param="continue_final_message")
            head = self.chat_prompt(messages[:-1], True, tools, chat_template_kwargs)
            try:
                tail = text_of(messages[-1].content, f"messages.{len(messages) - 1}.content")
            except ValueError as e:
                raise OpenAIError(400, str(e), param="messages") from None
            text = head["prompt"] + tail
            return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}
        conversation, images = [], []
        for i, m in enumerate(messages):
            try:
                content = template_content(m.content, f"messages.{i}.content", images, self.image_source)
            except ValueError as e:  # an image's InvalidRequest names its part
                raise OpenAIError(400, str(e), param=getattr(e, "param", None) or "messages") from None
            message: dict[str, Any] = {"role": m.role, "content": content}
            if m.tool_calls:
                message["tool_calls"] = [_template_call(call) for call in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                message["name"] = m.name
            thinking = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if thinking is not None:
                message["reasoning_content"] = thinking
            conversation.append(message)
        try:
            return render_conversation(self.tokenizer, conversation, add_generation_prompt,
                                       [t.model_dump(exclude_none=True) for t in tools or []],
                                       chat_template_kwargs=chat_template_kwargs, images=images,
                                       image_prompt=self.client.model_info.image_prompt)
        except ValueError as e:
            param = "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else "messages"
            raise OpenAIError(400, str(e), param=param) from None

    def _tool_choice(self, req: ChatCompletionRequest) -> Any:
        """The effective tool_choice: "none", "auto", "required" or the named-function dict.
        Without one: "auto" when tools are given and the server reads calls, else "none"."""
        choice = req.tool_choice
        if choice is None:
            return "auto" if req.tools and self.tool_call_parser else "none"
        if isinstance(choice, str):
            if choice != "none" and not req.tools:
                raise OpenAIError(400, f'tool_choice "{choice}" needs tools', param="tool_choice")
            if choice == "auto" and self.tool_call_parser is None:
                raise OpenAIError(400, 'tool_choice "auto" needs the server started with --enable-auto-tool-choice '
                                       "and --tool-call-parser", param="tool_choice")
            return choice
        names = [t.function.name for t in req.tools or []]
        if choice.function.name not in names:
            raise OpenAIError(400, f"tool_choice names the function {choice.function.name!r}, which is not among "
                                   f"the tools ({', '.join(names) or 'none'})", param="tool_choice")
        return choice.model_dump()

    def _constraint(self, req: ChatCompletionRequest, tool_choice: Any) -> tuple[StructuredOutputsParams | None, str]:
        """(constraint, the field it comes from): a forced tool choice's JSON schema, else
        response_format / structured_outputs."""
        if tool_choice != "required" and not isinstance(tool_choice, dict):
            return structured_outputs_of(req), constraint_field(req)
        if (req.response_format is not None and req.response_format.type != "text") or req.structured_outputs:
            raise OpenAIError(400, f"tool_choice {json.dumps(tool_choice)} constrains the output: it cannot be "
                                   "combined with response_format or structured_outputs", param="tool_choice")
        functions = [t.function.model_dump(exclude_none=True) for t in req.tools]
        if tool_choice == "required":
            schema = required_schema(functions, req.parallel_tool_calls)
        else:
            schema = named_schema(next(f for f in functions if f["name"] == tool_choice["function"]["name"]))
        try:
            return StructuredOutputsParams(json=schema, disable_any_whitespace=True), "tools"
        except ValueError as e:
            raise OpenAIError(400, str(e), param="tools") from None

    # ---- the request ---------------------------------------------------------------------------
    async def start_chat(self, req: ChatCompletionRequest, raw: Request, request_id: str | None = None) -> ChatRun:
        """The engine's request for a chat request, queued: every chat API converts its request to
        a ChatCompletionRequest and comes here (the template, sampling, tool choice and its
        constraint, the reply format), then renders the run's outputs in its own shapes."""
        lora = self.check_model(req.model)
        tool_choice = self._tool_choice(req)
        check_bounds(req, self.config)  # before the template's work
        # As vLLM: tools reach the template even for "none". Off the event loop: a long
        # conversation must not stall other clients.
        kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:  # OpenAI's switch, as the template's (Qwen3's) enable_thinking
            kwargs.setdefault("enable_thinking", req.reasoning_effort != "none")
        prompt = await asyncio.to_thread(self.chat_prompt, req.messages, req.add_generation_prompt, req.tools,
                                         kwargs or None, req.continue_final_message)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = req.top_logprobs if req.top_logprobs is not None else 0
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        constraint, constraint_param = self._constraint(req, tool_choice)
        thinking = self.thinking_span  # a constraint holds the answer after it; a budget bounds it
        if req.max_thinking_tokens is not None and req.max_thinking_tokens < 0:
            raise OpenAIError(400, f"max_thinking_tokens must be >= 0, got {req.max_thinking_tokens}",
                              param="max_thinking_tokens")
        if thinking is not None and req.max_thinking_tokens is not None:
            thinking = dataclasses.replace(thinking, budget=req.max_thinking_tokens)
        params = self.sampling_params(req, max_tokens, top if req.logprobs else None, structured=constraint,
                                      thinking=thinking)
        form = self.reply_format(tool_choice, req.tools, constraint is not None and thinking is None,
                                 req.parallel_tool_calls)
        if form.keeps_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        request_id = request_id or random_id("chatcmpl")
        streams = await self._start(raw, [request_id], [prompt], params, req.priority, constraint_param, "messages",
                                    lora)
        return ChatRun(request_id, streams, params, form, constraint_param, len(prompt["prompt_token_ids"]),
                       self.model_name(req.model))

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        run = await self.start_chat(req, raw)
        request_id, streams, params, form, constraint_param = (run.request_id, run.streams, run.params, run.form,
                                                               run.constraint_param)
        top = req.top_logprobs if req.top_logprobs is not None else 0
        if req.stream:
            return self._streaming(self._chat_events(req, request_id, streams, params, form, constraint_param))
        (out,) = await self._finals(streams, raw, constraint_param)
        choices = []
        for o in out.outputs:
            reader = form.reader()
            reply = reader.read(o.text)
            reasoning = reply.reasoning if req.include_reasoning else None
            content = reply.content if reader.reads_calls or reply.reasoning else reply.content or ""
            message = ChatMessageOut(content=content, reasoning_content=reasoning, reasoning=reasoning,
                                     tool_calls=[_call_out(c) for c in reply.calls] or None)
            choices.append(ChatChoice(
                index=o.index, message=message,
                logprobs=self._chat_logprobs(o.token_ids, o.logprobs, top) if req.logprobs else None,
                finish_reason=_finish_reason(o.finish_reason, bool(reply.calls)), stop_reason=o.stop_reason))
        return JSONResponse(ChatCompletionResponse(id=request_id, model=self.model_name(req.model), choices=choices,
                                                   usage=final_usage([out])).model_dump())

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[PositionLogprobs] | None,
                       num_top: int) -> ChatLogprobs:
        content = []
        for token_id, position in zip(token_ids, logprobs or []):
            token = self._token_text(token_id)
            top = sorted(position.values(), key=lambda p: p.rank)
            content.append(TokenLogprob(token=token, logprob=position[token_id].logprob, bytes=list(token.encode()),
                                        top_logprobs=[TopLogprob(token=p.decoded_token, logprob=p.logprob,
                                                                 bytes=list(p.decoded_token.encode()))
                                                      for p in top if p.rank <= num_top]))
        return ChatLogprobs(content=content)

    async def _chat_events(self, req: ChatCompletionRequest, request_id: str, streams: list[RequestStream],
                           params: SamplingParams, form: ReplyFormat, constraint_param: str) -> AsyncIterator[dict]:
        """A chunk per tool-call event (a call's id and name, then its arguments), and one per
        DELTA output of a choice that brings thinking, content or its finish; tokens that brought
        none (held back: a partial character or tag, text still to be read as calls) go out with
        the next."""
        def chunk(choice: ChatStreamChoice | None, usage: UsageInfo | None = None) -> dict:
            body = ChatCompletionChunk(id=request_id, model=self.model_name(req.model),
                                       choices=[choice] if choice else [], usage=usage).model_dump()
            for c in body["choices"]:  # a delta carries only what it brings, as OpenAI's do
                calls = c["delta"].pop("tool_calls")
                if calls is not None:
                    c["delta"]["tool_calls"] = [_without_none(call) for call in calls]
                for name in ("reasoning_content", "reasoning"):
                    if c["delta"][name] is None:
                        del c["delta"][name]
            return body

        progress = {i: ChoiceProgress() for i in range(params.n)}
        readers = {i: form.reader() for i in range(params.n)}
        for i in range(params.n):
            yield chunk(ChatStreamChoice(index=i, delta=ChatDelta(role="assistant", content="")))
        first: RequestOutput | None = None  # the output that carries the prompt
        async for _, out in self._merged(streams, constraint_param):
            if first is None:
                first = out
            for o in out.outputs:
                state, reader = progress[o.index], readers[o.index]
                state.num_tokens += len(o.token_ids)
                if req.logprobs:
                    state.pending_token_ids += o.token_ids
                    state.pending_logprobs += o.logprobs or []
                reasoning = content = ""
                for event in reader.feed(o.text, o.finish_reason is not None):
                    if isinstance(event, Thinking):
                        reasoning += event.text if req.include_reasoning else ""
                    elif isinstance(event, Text):
                        content += event.text
                    elif isinstance(event, CallOpened):
                        yield chunk(_call_delta(o.index, DeltaToolCall(index=event.index, id=event.call.id,
                                                                       type="function", function=DeltaFunctionCall(
                                                                           name=event.call.name, arguments=""))))
                    elif event.text:
                        yield chunk(_call_delta(o.index, DeltaToolCall(index=event.index, function=DeltaFunctionCall(
                            arguments=event.text))))
                if not content and not reasoning and o.finish_reason is None:
                    continue
                logprobs = None
                if req.logprobs:
                    logprobs = self._chat_logprobs(state.pending_token_ids, state.pending_logprobs,
                                                   params.logprobs or 0)
                    state.pending_token_ids, state.pending_logprobs = [], []
                yield chunk(ChatStreamChoice(
                    index=o.index, delta=ChatDelta(content=content if not (reader.reads_calls or reasoning)
                                                   else content or None,
                                                   reasoning_content=reasoning or None, reasoning=reasoning or None),
                    logprobs=logprobs, finish_reason=_finish_reason(o.finish_reason, reader.num_calls > 0),
                    stop_reason=o.stop_reason))
        if req.stream_options and req.stream_options.include_usage and first is not None:
            yield chunk(None, usage_info(len(first.prompt_token_ids), sum(c.num_tokens for c in progress.values()),
                                         first.num_cached_tokens))


def thinking_span(tokenizer: Any, reasoning_parser: str | None) -> ThinkingSpan | None:
    """Where a reasoning model's thinking is, for a constraint to hold only the answer after it:
    the tags' token ids, where the vocabulary has each as one token (Qwen3's, DeepSeek-R1's);
    else None, and a constraint holds the reply from its first token (all answer)."""
    if reasoning_parser is None:
        return None
    end = tokenizer.hf_tokenizer.token_to_id(END)
    start = tokenizer.hf_tokenizer.token_to_id(START)
    if end is None or (start is None and not REASONING_PARSERS[reasoning_parser]):
        return None
    return ThinkingSpan(end=end, start=None if REASONING_PARSERS[reasoning_parser] else start)


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    return value


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as chat templates take it: arguments as an object where they parse."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return {**call, "type": call.get("type", "function"), "function": function}


def _call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def _call_delta(index: int, delta: DeltaToolCall) -> ChatStreamChoice:
    return ChatStreamChoice(index=index, delta=ChatDelta(tool_calls=[delta]))


def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """A reply that ended by itself with calls in it ends for "tool_calls", as OpenAI says."""
    return "tool_calls" if has_calls and reason == "stop" else reason
