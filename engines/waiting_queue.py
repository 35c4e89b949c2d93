"""The waiting-queue order: priority class first, then earliest TTFT deadline, with aging so no class starves.

Aging is folded into one static key, `deadline + priority * aging_s` (lower priority numbers run first, as in
vLLM): a class's advantage is worth `aging_s` seconds of deadline, so work of a lower class is overtaken by
newer higher-class work for at most about `aging_s` per class of difference. A static key keeps every
operation O(log n) on a heap (no re-keying as time passes); `aging_s=inf` gives strict priority, then EDF.
With `expires`, a second heap by expiry time lets `pop_expired` hand back, in O(log n) each, the items whose
deadline has passed (deadline-aware dropping: a request that can no longer meet its TTFT is not served late).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")

# What the queue needs to know about an item: (unique id, priority class, TTFT deadline on the clock in use).
Describe = Callable[[T], tuple[Hashable, int, float]]
# When an item may be dropped for lateness (None: never), and whether it still may be when that time comes.
Expires = Callable[[T], float | None]

_REMOVED = object()


class WaitingQueue(Generic[T]):
    """A heap of waiting items; push/pop O(log n), peek O(1) amortised, remove O(1) (lazy deletion)."""

    __slots__ = ("describe", "aging_s", "expires", "_heap", "_live", "_counter", "_expiry")

    def __init__(self, describe: Describe, *, aging_s: float = 30.0, expires: Expires | None = None):
        if not aging_s > 0:
            raise ValueError(f"aging_s must be positive (math.inf for strict priority), got {aging_s}")
        self.describe = describe
        self.aging_s = aging_s
        self._heap: list[list] = []  # [rank, fifo tie-break, id, item]; item := _REMOVED when removed
        self._live: dict[Hashable, list] = {}
        self._counter = itertools.count()
        self.expires = expires
        self._expiry: list[tuple[float, int, list]] = []  # (expiry, fifo, entry of _heap); stale when removed

    def rank(self, priority: int, deadline: float) -> tuple[float, float]:
        """The sort key of an item: smaller runs first."""
        if math.isinf(self.aging_s):
            return (float(priority), deadline)
        return (0.0, deadline + priority * self.aging_s)

    def push(self, item: T) -> None:
        item_id, priority, deadline = self.describe(item)
        if item_id in self._live:
            raise ValueError(f"item {item_id!r} is already waiting")
        entry = [self.rank(priority, deadline), next(self._counter), item_id, item]
        self._live[item_id] = entry
        heapq.heappush(self._heap, entry)
        if self.expires is not None:
            at = self.expires(item)
            if at is not None:
                heapq.heappush(self._expiry, (at, entry[1], entry))

    def pop_expired(self, now: float, may_drop: Callable[[T], bool] | None = None) -> list[T]:
        """Remove and return the items whose expiry is at or before `now` (earliest first); an item for which
        `may_drop` says False stays queued and is not offered again (its expiry is forgotten)."""
        out: list[T] = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)[2]
            item = entry[3]
            if item is _REMOVED or self._live.get(entry[2]) is not entry:
                continue  # already popped or removed (or pushed again since: its new entry has its own expiry)
            if may_drop is None or may_drop(item):
                self.remove(entry[2])
                out.append(item)
        return out

    def peek(self) -> T | None:
        """The item `pop` would return, or None when empty."""
        heap = self._heap
        while heap and heap[0][3] is _REMOVED:
            heapq.heappop(heap)
        return heap[0][3] if heap else None

    def pop(self) -> T:
        """Remove and return the first item; IndexError when empty."""
        heap = self._heap
        while heap:
            entry = heapq.heappop(heap)
            item = entry[3]
            if item is not _REMOVED:
                del self._live[entry[2]]
                entry[3] = _REMOVED  # its expiry entry, if any, is now stale
                return item
        raise IndexError("pop from an empty WaitingQueue")

    def remove(self, item_id: Hashable) -> T | None:
        """Take an item out wherever it is (abort); returns it, or None if it was not waiting."""
        entry = self._live.pop(item_id, None)
        if entry is None:
            return None
        item = entry[3]
        entry[3] = _REMOVED
        if len(self._heap) > 64 and len(self._heap) > 2 * len(self._live):  # keep dead entries bounded
            self._heap = [e for e in self._heap if e[3] is not _REMOVED]
            heapq.heapify(self._heap)
        if len(self._expiry) > 64 and len(self._expiry) > 2 * len(self._live):
            self._expiry = [x for x in self._expiry if x[2][3] is not _REMOVED]
            heapq.heapify(self._expiry)
        return item

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, item_id: Hashable) -> bool:
        return item_id in self._live
