"""Request bodies of OpenAI's Responses API (/v1/responses): the fields dabba reads; others are
accepted and ignored, as the other bodies' are. Input items stay dicts here: their conversion
(serving_responses.py) checks each and names the one that is wrong."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from dabba.entrypoints.openai.protocol import OpenAIModel, OpenAIRequest


class FunctionTool(OpenAIModel):
    type: str  # "function"; the hosted tools (web_search, file_search, ...) are refused by name
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None


class ReasoningConfig(OpenAIModel):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None


class ResponsesRequest(OpenAIRequest):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's extras, as on chat
    top_k: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
