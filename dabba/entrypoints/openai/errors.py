"""The errors the OpenAI server answers in OpenAI's shape, and which request field an engine's
InvalidRequest names."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from dabba.engine.protocol import InvalidRequest
from dabba.entrypoints.anthropic.errors import error_response as anthropic_error, speaks_anthropic
from dabba.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ErrorInfo, ErrorResponse


class OpenAIError(Exception):
    """An error the client made (or one to show it), with its HTTP status and OpenAI type."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers  # e.g. a 503's Retry-After

    def response(self, path: str = "") -> JSONResponse:
        """In OpenAI's shape, or in Anthropic's for a request to the Messages API (``path``)."""
        if speaks_anthropic(path):
            response = anthropic_error(self.status, self.message)
        else:
            body = ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                                 code=self.code))
            response = JSONResponse(body.model_dump(), status_code=self.status)
        response.headers.update(self.headers or {})
        return response


def param_of(error: ValueError, prompt_param: str = "prompt",
              constraint_param: str = "structured_outputs") -> str | None:
    """The request field an engine's InvalidRequest names: its prompt errors name the field the
    prompt came from (``prompt_param``), its constraint errors the one the constraint came from
    (``constraint_param``); an engine field that is no request field names nothing."""
    param = error.param if isinstance(error, InvalidRequest) else None
    if param in ("prompt", "prompt_token_ids", "multi_modal_data"):  # (a prompt's images)
        return prompt_param
    if param == "structured_outputs":
        return constraint_param
    return param if param in REQUEST_FIELDS else None


REQUEST_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)
