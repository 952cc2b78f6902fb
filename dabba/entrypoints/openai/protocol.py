"""Request and response bodies of the OpenAI API (plus vLLM's extra sampling fields)."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def find_lone_surrogate(value: Any, path: tuple = ()) -> tuple[tuple, str] | None:
    """(where, the character) of the first string in a parsed JSON body holding a lone UTF-16
    surrogate: JSON's "\\ud800" escape decodes to one, and no tokenizer or UTF-8 encoder takes it.
    Depth first in document order (a key before its value), on a stack of its own: recursion
    overflowed on bodies nested ~950 deep, which the JSON parser still takes (a 500)."""
    stack: list[tuple[tuple, Any]] = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                return where, item[e.start]
            continue
        entries = item.items() if isinstance(item, dict) else enumerate(item) if isinstance(item, list) else ()
        children: list[tuple[tuple, Any]] = []
        for key, child in entries:
            if isinstance(key, str):
                children.append((where + (key,), key))
            if isinstance(child, (str, dict, list)):
                children.append((where + (key,), child))
        stack.extend(reversed(children))
    return None


class OpenAIModel(BaseModel):
    # Unknown fields are accepted and ignored, as OpenAI-compatible servers do (clients send
    # fields like "user"); fields dabba cannot honour are rejected explicitly in serving. Types
    # are strict, as OpenAI's API is: "yes" is not a boolean, 1.0 not a token id or a count.
    model_config = ConfigDict(extra="ignore", strict=True)


class OpenAIRequest(OpenAIModel):
    """A request body: no string in it may hold a lone surrogate (a 400 naming where).
    ``keep_alive`` (Ollama's, for a server of several models): how long the model stays loaded
    once idle, seconds or a duration such as "5m"; negative: for good; 0: unloaded once idle."""

    keep_alive: float | str | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        found = find_lone_surrogate(data)
        if found is not None:
            where, char = found
            raise PydanticCustomError("lone_surrogate", "{where}: contains a lone UTF-16 surrogate ({char}), which "
                                      "is not valid Unicode", {"where": ".".join(map(str, where)) or "body",
                                                               "char": ascii(char), "path": list(where)})
        return data


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(OpenAIRequest):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    response_format: ResponseFormat | None = None  # OpenAI's (chat); vLLM takes it on completions too
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar, json_object


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers
    reasoning_content: str | None = None  # assistant: its thinking, as a reasoning parser split it
    reasoning: str | None = None  # the same, as vLLM now spells it


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the reply continues the last (assistant) message
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # the template's own variables (enable_thinking, ...)
    include_reasoning: bool = True  # vLLM's: False drops the thinking a reasoning parser split off
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None  # "none": enable_thinking off
    max_thinking_tokens: int | None = None  # dabba's: the thinking's budget, then </think> is forced


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _ResponseBase(BaseModel):
    """The envelope every completion response and stream chunk shares."""

    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: UsageInfo | None = None


class CompletionResponse(_ResponseBase):
    object: str = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: str = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # the thinking (--reasoning-parser), as DeepSeek's API names it
    reasoning: str | None = None  # the same, as vLLM now names it
    tool_calls: list[ToolCallOut] | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of call ``index``: its id, type and name first, then argument fragments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class _ChatChoiceBase(BaseModel):
    index: int
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatChoice(_ChatChoiceBase):
    message: ChatMessageOut


class ChatStreamChoice(_ChatChoiceBase):
    delta: ChatDelta


class ChatCompletionResponse(_ResponseBase):
    object: str = "chat.completion"
    choices: list[ChatChoice]


class ChatCompletionChunk(_ResponseBase):
    object: str = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


class TokenizeRequest(OpenAIRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(OpenAIRequest):  # vLLM's /v1/load_lora_adapter
    lora_name: str
    lora_path: str
    base_model_name: str | None = None  # which model's adapter (vLLM's name; needed with several models)


class UnloadLoRAAdapterRequest(OpenAIRequest):
    lora_name: str
    base_model_name: str | None = None


class ModelOperation(OpenAIRequest):  # POST /models/load and /models/unload
    model: str


class CacheReset(OpenAIRequest):  # POST /cache/reset
    model: str | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
