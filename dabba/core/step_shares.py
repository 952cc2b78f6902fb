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

    def _left(self, request: Request) -> int | None:
        if request.pooling_params is not None:
            return self.pooling
        return self.image if image_prefill(request) else None

    def limit(self, request: Request, num_new: int) -> int:
        """``num_new`` cut to what the request's kind has left."""
        left = self._left(request)
        return num_new if left is None else min(num_new, left)

    def take(self, request: Request, num_new: int) -> None:
        if request.pooling_params is not None:
            if self.pooling is not None:
                self.pooling -= num_new
        elif self.image is not None and image_prefill(request):
            self.image -= num_new
