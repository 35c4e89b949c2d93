"""The Responses API's server-side store: each stored response (and the conversation that led to it, for a later
`previous_response_id`) kept for a while, bounded in count, the oldest dropped first; expired ones are gone.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

STORE_CAPACITY = 1024  # responses held at once; the oldest is dropped for a new one
STORE_TTL_S = 3600.0  # a stored response expires an hour after it was made


@dataclass
class Stored:
    body: dict[str, Any]  # the response object, as GET /v1/responses/{id} answers it
    conversation: list[dict[str, Any]]  # chat messages: its input (instructions aside) and its output
    expires: float


class ResponseStore:
    """id -> Stored, at most `capacity`, each for `ttl_s` seconds (clock injectable for tests)."""

    def __init__(self, capacity: int = STORE_CAPACITY, ttl_s: float = STORE_TTL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.capacity, self.ttl_s, self.clock = capacity, ttl_s, clock
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response_id: str, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        now = self.clock()
        self._expire(now)
        self._items[response_id] = Stored(body, conversation, now + self.ttl_s)
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        self._expire(self.clock())
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)

    def _expire(self, now: float) -> None:
        while self._items:  # insertion order is expiry order: every entry lives ttl_s
            oldest = next(iter(self._items.values()))
            if oldest.expires > now:
                return
            self._items.popitem(last=False)
