"""How many LoRA adapters one step may use: the worker holds ``max_loras`` of them in its slots,
so the running requests use at most that many distinct adapters, and a waiting request with yet
another one waits until a running adapter's last request leaves."""
from __future__ import annotations

from dabba.core.request import Request


class AdaptersInUse:
    def __init__(self, max_loras: int, running: list[Request]) -> None:
        self.max_loras = max_loras
        self.identities = {r.lora.identity for r in running if r.lora is not None}

    def admits(self, request: Request) -> bool:
        lora = request.lora
        return lora is None or lora.identity in self.identities or len(self.identities) < self.max_loras

    def add(self, request: Request) -> None:
        if request.lora is not None:
            self.identities.add(request.lora.identity)
