"""The shares of a step that rationed kinds of work may still take while generation requests
decode: pooling requests' tokens (core/pooling_budget.py) and image requests' prompt tokens
(core/image_budget.py); None: no limit on that kind this step."""
from __future__ import annotations

from dataclasses import dataclass

from dabba.core.image_budget import image_prefill
from dabba.core.request import Request


@dataclass
class StepShares:
    pooling: int | None = None
    image: int | None = None

    def _kind(self, request: Request) -> str | None:
        if request.pooling_params is not None:
            return "pooling"
        return "image" if image_prefill(request) else None

    def limit(self, request: Request, num_new: int) -> int:
        """``num_new`` cut to what the request's kind has left."""
        kind = self._kind(request)
        left = None if kind is None else getattr(self, kind)
        return num_new if left is None else min(num_new, left)

    def take(self, request: Request, num_new: int) -> None:
        kind = self._kind(request)
        if kind is not None and getattr(self, kind) is not None:
            setattr(self, kind, getattr(self, kind) - num_new)
