"""Errors a caller's request can cause, shared by every layer that validates one (torch-free: the
core raises them too)."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine refuses, naming the field at fault (``param``: a SamplingParams field,
    "prompt", "structured_outputs", "priority", or None when no one field is).

    The servers map ``param`` to their own API's field and status without reading the message;
    Python callers catch it as the ValueError it is."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class Overloaded(RuntimeError):
    """A request refused because a shared resource (the grammar compilers' queue) is full: the
    request is fine and may be retried later (a server answers 503)."""
