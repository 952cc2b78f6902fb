"""Request and response bodies of Anthropic's Messages API (the fields dabba reads; others are
accepted and ignored, as the OpenAI bodies are)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from dabba.entrypoints.openai.protocol import OpenAIModel, OpenAIRequest


class ToolDefinition(OpenAIModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" or absent: Anthropic's server tools (bash, web search, ...) are not run here


class ToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(OpenAIModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class MessageParam(OpenAIModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class OutputFormat(OpenAIModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIModel):
    format: OutputFormat | None = None


class CountTokensRequest(OpenAIRequest):
    model: str
    messages: list[MessageParam]
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0  # prompt tokens found in the prefix cache


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage
