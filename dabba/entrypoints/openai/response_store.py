"""The Responses API's stored responses (``store: true``, the default): what GET /v1/responses/{id}
returns, what ``previous_response_id`` continues, what cancel stops. Held in memory, at most
``capacity`` of them: storing one more evicts the least recently used (stored, read or continued)."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from dabba.engine.protocol import RequestStream


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the Response object as last rendered
    conversation: list[dict[str, Any]]  # chat messages: the input (without instructions) and this output
    streams: list[RequestStream] = field(default_factory=list)  # while in progress: what cancel aborts
    cancelled: bool = False


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = stored
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)
