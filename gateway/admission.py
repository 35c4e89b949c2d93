"""Admission control: predict a new request's TTFT from the prompt tokens queued ahead of it on its engine and
the engine's measured prefill drain rate, then admit it, downgrade it to the route's small engine, or shed it
with 503 and a Retry-After taken from the queue's drain time. Queues are bounded per route.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from gateway.config import RouteConfig

Action = Literal["admit", "downgrade", "shed"]


class AdmissionDecision(msgspec.Struct, frozen=True, kw_only=True):
    """The verdict on one request: what to do, on which engine, and why (reasons are stable snake_case)."""

    action: Action
    engine: str | None  # the engine to run on (None when shed)
    reason: str  # admit: within_slo | no_slo | warming_up | slo_unreachable; downgrade: small_meets_slo;
    #              shed: queue_full | slo_miss
    predicted_ttft_s: float | None = None  # on the engine finally chosen (or the requested one when shed)
    target_ttft_s: float | None = None
    retry_after_s: float | None = None  # shed only: seconds until the queue ahead should have drained
    status: int | None = None  # shed only: the HTTP status to answer (503: overload)

    @property
    def admitted(self) -> bool:
        return self.action != "shed"


@dataclass
class AdmissionSettings:
    """Knobs of admission control (their config home: an `[admission]` section, per-route `max_waiting`)."""

    max_waiting_per_route: int = 256  # requests admitted and still waiting for their first token
    route_max_waiting: dict[str, int] = field(default_factory=dict)  # per-route overrides
    ttft_slack: float = 1.0  # admit while predicted TTFT <= slack * target
    rate_halflife_s: float = 10.0  # how fast the prefill-rate estimate forgets
    min_rate_observations: int = 3  # first tokens seen before predictions are trusted
    min_retry_after_s: float = 1.0
    max_retry_after_s: float = 60.0


class _EngineBacklog:
    """Prompt tokens admitted to one engine and not yet prefilled, by priority, and the engine's drain rate.

    The rate is tokens whose first token arrived per second *during which the backlog was non-empty*, with
    exponential forgetting; counting backlogged wall time once (not per request) makes it the engine's
    aggregate prefill throughput under its current decode load, whatever the batching.
    """

    __slots__ = ("tokens_by_priority", "num_waiting", "credited_tokens", "backlog_s", "observations", "_last")

    def __init__(self, now: float):
        self.tokens_by_priority: dict[int, int] = {}
        self.num_waiting = 0
        self.credited_tokens = 0.0
        self.backlog_s = 0.0
        self.observations = 0
        self._last = now

    def advance(self, now: float, halflife_s: float) -> None:
        dt = now - self._last
        if dt <= 0:
            return
        decay = 0.5 ** (dt / halflife_s)
        self.credited_tokens *= decay
        busy = self.backlog_s * decay
        if self.num_waiting > 0:
            busy += dt
        self.backlog_s = busy
        self._last = now

    def rate(self, min_observations: int) -> float | None:
        if self.observations < min_observations or self.backlog_s <= 0 or self.credited_tokens <= 0:
            return None
        return self.credited_tokens / self.backlog_s

    def tokens_ahead(self, priority: int) -> int:
        # lower numbers run first: equal-class work queued earlier is ahead too (deadline order is close to FIFO)
        return sum(t for p, t in self.tokens_by_priority.items() if p <= priority)

    def add(self, priority: int, tokens: int) -> None:
        self.tokens_by_priority[priority] = self.tokens_by_priority.get(priority, 0) + tokens
        self.num_waiting += 1

    def drop(self, priority: int, tokens: int) -> None:
        left = self.tokens_by_priority.get(priority, 0) - tokens
        if left > 0:
            self.tokens_by_priority[priority] = left
        else:
            self.tokens_by_priority.pop(priority, None)
        self.num_waiting -= 1


@dataclass(slots=True)
class _Waiting:
    route: str
    engine: str
    priority: int
    tokens: int


class AdmissionController:
    """Decides admit / downgrade / shed per request and keeps the per-engine backlog ledger.

    Call it from the event loop only (no locks). Per request: `admit()` before starting the engine, then
    exactly one of `first_token()` (prefill done) or `release()` (ended or failed before its first token).
    """

    def __init__(self, routes: Mapping[str, RouteConfig], settings: AdmissionSettings | None = None, *,
                 clock: Callable[[], float] = time.monotonic):
        self.routes = routes
        self.settings = settings or AdmissionSettings()
        self.clock = clock
        self._engines: dict[str, _EngineBacklog] = {}
        self._waiting: dict[str, _Waiting] = {}
        self._route_waiting: dict[str, int] = {}

    # ---- reading the state -------------------------------------------------------------------------------
    def _backlog(self, engine: str) -> _EngineBacklog:
        backlog = self._engines.get(engine)
        if backlog is None:
            backlog = self._engines[engine] = _EngineBacklog(self.clock())
        return backlog

    def prefill_rate(self, engine: str) -> float | None:
        """Measured prefill drain rate of `engine` in tokens/s (None until enough first tokens were seen)."""
        backlog = self._backlog(engine)
        backlog.advance(self.clock(), self.settings.rate_halflife_s)
        return backlog.rate(self.settings.min_rate_observations)

    def predicted_ttft(self, engine: str, priority: int, prompt_tokens: int) -> float | None:
        """Seconds until a new request's first token: the tokens ahead of it plus its own, at the drain rate."""
        rate = self.prefill_rate(engine)
        if rate is None:
            return None
        return (self._backlog(engine).tokens_ahead(priority) + prompt_tokens) / rate

    def num_waiting(self, route: str | None = None) -> int:
        """Requests admitted and still waiting for their first token (one route, or all)."""
        return len(self._waiting) if route is None else self._route_waiting.get(route, 0)

    def waiting_by_engine(self) -> dict[str, int]:
        return {name: b.num_waiting for name, b in self._engines.items()}

    # ---- deciding ----------------------------------------------------------------------------------------
    def decide(self, route: str, engine: str, prompt_tokens: int) -> AdmissionDecision:
        """The verdict for a request of `route` that routing sent to `engine`; changes no state."""
        cfg = self.routes.get(route)
        s = self.settings
        priority = cfg.priority if cfg is not None else 0
        ttft_ms = cfg.slo.ttft_ms if cfg is not None else None
        target = ttft_ms / 1000.0 if ttft_ms is not None else None
        limit = s.route_max_waiting.get(route, s.max_waiting_per_route)
        predicted = self.predicted_ttft(engine, priority, prompt_tokens)

        if self._route_waiting.get(route, 0) >= limit:
            return self._shed("queue_full", engine, priority, prompt_tokens, predicted, target, 0.0)
        if target is None:
            return AdmissionDecision(action="admit", engine=engine, reason="no_slo", predicted_ttft_s=predicted)
        if predicted is None:
            return AdmissionDecision(action="admit", engine=engine, reason="warming_up", target_ttft_s=target)
        budget = s.ttft_slack * target
        if predicted <= budget:
            return AdmissionDecision(action="admit", engine=engine, reason="within_slo",
                                     predicted_ttft_s=predicted, target_ttft_s=target)
        small = cfg.engines[0] if cfg is not None and len(cfg.engines) > 1 else None
        if cfg is not None and cfg.allow_downgrade and small is not None and small != engine:
            on_small = self.predicted_ttft(small, priority, prompt_tokens)
            if on_small is not None and on_small <= budget:
                return AdmissionDecision(action="downgrade", engine=small, reason="small_meets_slo",
                                         predicted_ttft_s=on_small, target_ttft_s=target)
        if self._backlog(engine).tokens_ahead(priority) == 0:
            # Nothing of its class is ahead: shedding cannot make it faster later, so serve it late.
            return AdmissionDecision(action="admit", engine=engine, reason="slo_unreachable",
                                     predicted_ttft_s=predicted, target_ttft_s=target)
        return self._shed("slo_miss", engine, priority, prompt_tokens, predicted, target, budget)

    def _shed(self, reason: str, engine: str, priority: int, prompt_tokens: int, predicted: float | None,
              target: float | None, budget_s: float) -> AdmissionDecision:
        """503 with Retry-After: the time for the queue ahead to drain until this request would fit."""
        s = self.settings
        rate = self.prefill_rate(engine)
        wait = s.min_retry_after_s
        if rate is not None:
            excess = self._backlog(engine).tokens_ahead(priority) + prompt_tokens - budget_s * rate
            wait = excess / rate
        wait = min(s.max_retry_after_s, max(s.min_retry_after_s, wait))
        return AdmissionDecision(action="shed", engine=None, reason=reason, predicted_ttft_s=predicted,
                                 target_ttft_s=target, retry_after_s=float(math.ceil(wait)), status=503)

    # ---- the ledger --------------------------------------------------------------------------------------
    def admit(self, request_id: str, route: str, engine: str, prompt_tokens: int) -> AdmissionDecision:
        """`decide`, and when admitted (or downgraded) enter the request into its engine's backlog."""
        if request_id in self._waiting:
            raise ValueError(f"request {request_id!r} was already admitted")
        decision = self.decide(route, engine, prompt_tokens)
        if decision.admitted:
            cfg = self.routes.get(route)
            priority = cfg.priority if cfg is not None else 0
            chosen = decision.engine or engine
            backlog = self._backlog(chosen)
            backlog.advance(self.clock(), self.settings.rate_halflife_s)
            backlog.add(priority, prompt_tokens)
            self._waiting[request_id] = _Waiting(route, chosen, priority, prompt_tokens)
            self._route_waiting[route] = self._route_waiting.get(route, 0) + 1
        return decision

    def first_token(self, request_id: str) -> None:
        """The request's prefill is done: its tokens leave the backlog and count toward the drain rate."""
        self._leave(request_id, credit=True)

    def release(self, request_id: str) -> None:
        """The request ended before its first token (abort, error, disconnect); idempotent."""
        self._leave(request_id, credit=False)

    def _leave(self, request_id: str, *, credit: bool) -> None:
        entry = self._waiting.pop(request_id, None)
        if entry is None:
            return
        backlog = self._engines[entry.engine]
        backlog.advance(self.clock(), self.settings.rate_halflife_s)
        backlog.drop(entry.priority, entry.tokens)
        if credit:
            backlog.credited_tokens += entry.tokens
            backlog.observations += 1
        left = self._route_waiting[entry.route] - 1
        if left:
            self._route_waiting[entry.route] = left
        else:
            del self._route_waiting[entry.route]
