"""Errors in Anthropic's shape: {"type": "error", "error": {"type": ..., "message": ...}}, with its
statuses (an overloaded server is 529, as Anthropic's is)."""
from __future__ import annotations

from fastapi.responses import JSONResponse

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}
OVERLOADED = 529


def speaks_anthropic(path: str) -> bool:
    """Whether a request's path is the Messages API's (whose errors take Anthropic's shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(status: int, message: str) -> JSONResponse:
    status = OVERLOADED if status == 503 else status
    return JSONResponse(error_body(status, message), status_code=status)
