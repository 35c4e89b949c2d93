"""Admission control: predict a new request's TTFT on the engine its route chose (prompt tokens ahead at the
measured prefill drain rate, or the wait for a decode slot, stretched by how much later than predicted its
class's recent first tokens came), then admit it, downgrade it to the route's small engine, or shed it with 503
and a Retry-After. Queues are bounded per route; a request that falls behind its deadline later is the engine's
to drop. The per-engine ledger behind the predictions also measures their error (`prediction_stats`).
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import msgspec

from gateway.config import AdmissionConfig, RouteConfig

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


class _Decayed:
    """A mean that forgets exponentially in wall time and keeps its value through idle time (no new samples)."""

    __slots__ = ("weight", "value", "seen", "last")

    def __init__(self, now: float):
        self.weight = 0.0
        self.value = 0.0
        self.seen = False
        self.last = now  # the time of the latest sample

    def add(self, now: float, halflife_s: float, value: float) -> None:
        dt = now - self.last
        if dt > 0:
            self.weight *= 0.5 ** (dt / halflife_s)
            self.last = now
        self.weight += 1.0
        self.value += (value - self.value) / self.weight
        self.seen = True

    @property
    def mean(self) -> float | None:
        return self.value if self.seen else None


class _EngineBacklog:
    """Prompt tokens admitted to one engine and not yet prefilled, by priority, and the engine's drain rate.

    The rate is tokens whose first token arrived per second *during which the backlog was non-empty*, with
    exponential forgetting; counting backlogged wall time once (not per request) makes it the engine's
    aggregate prefill throughput under its current decode load, whatever the batching.
    """

    __slots__ = ("tokens_by_priority", "count_by_priority", "num_waiting", "num_running", "credited_tokens",
                 "backlog_s", "observations", "_last", "decode_s", "errors", "actual_s", "queued_s")

    def __init__(self, now: float):
        self.tokens_by_priority: dict[int, int] = {}
        self.count_by_priority: dict[int, int] = {}
        self.num_waiting = 0
        self.num_running = 0  # first token seen, not yet ended: holding a decode slot
        self.credited_tokens = 0.0
        self.backlog_s = 0.0
        self.observations = 0
        self._last = now
        self.decode_s = _Decayed(now)  # how long a request holds its slot after its first token
        self.errors: dict[int, _PredictionErrors] = {}  # per priority
        # per priority, recent actual TTFTs and what the queue ahead predicted for them (same weights: their
        # ratio is the measured stretch, e.g. higher-priority arrivals overtaking a waiting request)
        self.actual_s: dict[int, _Decayed] = {}
        self.queued_s: dict[int, _Decayed] = {}

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

    def stretch(self, priority: int, min_observations: int, now: float, halflife_s: float) -> float:
        """Measured actual / queue-predicted TTFT of recent first tokens of this class, at least 1. Its excess
        over 1 fades by half per half-life without a new first token of the class: a stretch measured in a
        burst would otherwise shed every later request of the class, so none could come back to correct it."""
        actual, queued = self.actual_s.get(priority), self.queued_s.get(priority)
        errors = self.errors.get(priority)
        if actual is None or queued is None or errors is None or errors.count < min_observations or queued.value <= 0:
            return 1.0
        excess = max(0.0, actual.value / queued.value - 1.0)
        return 1.0 + excess * 0.5 ** (max(0.0, now - actual.last) / halflife_s)

    def tokens_ahead(self, priority: int) -> int:
        # lower numbers run first: equal-class work queued earlier is ahead too (deadline order is close to FIFO)
        return sum(t for p, t in self.tokens_by_priority.items() if p <= priority)

    def requests_ahead(self, priority: int) -> int:
        return sum(n for p, n in self.count_by_priority.items() if p <= priority)

    def add(self, priority: int, tokens: int) -> None:
        self.tokens_by_priority[priority] = self.tokens_by_priority.get(priority, 0) + tokens
        self.count_by_priority[priority] = self.count_by_priority.get(priority, 0) + 1
        self.num_waiting += 1

    def drop(self, priority: int, tokens: int) -> None:
        left = self.tokens_by_priority.get(priority, 0) - tokens
        if left > 0:
            self.tokens_by_priority[priority] = left
        else:
            self.tokens_by_priority.pop(priority, None)
        n = self.count_by_priority.get(priority, 0) - 1
        if n > 0:
            self.count_by_priority[priority] = n
        else:
            self.count_by_priority.pop(priority, None)
        self.num_waiting -= 1


class _PredictionErrors:
    """Predicted vs actual TTFT of one engine and priority: running totals and the latest pairs."""

    __slots__ = ("count", "sum_error", "sum_abs_error", "within_20pct", "late", "pairs")

    def __init__(self) -> None:
        self.count = 0
        self.sum_error = 0.0  # actual - predicted: > 0 means the prediction was optimistic
        self.sum_abs_error = 0.0
        self.within_20pct = 0  # |error| <= max(20% of actual, 50 ms)
        self.late = 0  # actual TTFT above its target
        self.pairs: collections.deque[tuple[float, float]] = collections.deque(maxlen=512)  # (predicted, actual)

    def observe(self, predicted: float, actual: float, target: float | None) -> None:
        err = actual - predicted
        self.count += 1
        self.sum_error += err
        self.sum_abs_error += abs(err)
        self.within_20pct += abs(err) <= max(0.2 * actual, 0.05)
        self.late += target is not None and actual > target
        self.pairs.append((predicted, actual))

    def summary(self) -> dict[str, float | int]:
        n = max(1, self.count)
        return {"count": self.count, "mean_error_s": self.sum_error / n, "mean_abs_error_s": self.sum_abs_error / n,
                "within_20pct": self.within_20pct / n, "late": self.late / n}


@dataclass(slots=True)
class _Waiting:
    route: str
    engine: str
    priority: int
    tokens: int
    admitted_at: float = 0.0
    predicted_s: float | None = None  # None: none was made (warming up)
    target_s: float | None = None
    queued_s: float | None = None  # the prediction from the queue ahead alone, before the measured stretch


class AdmissionController:
    """Decides admit / downgrade / shed per request and keeps the per-engine backlog ledger.

    Call it from the event loop only (no locks). Per engine request: `admit()` (or `book()` for a second engine
    of a request already admitted) before starting it, then `first_token()` when its prefill is done (if it gets
    that far), and `release()` when it ends, whichever way (idempotent; after `first_token()` it frees the
    request's decode slot in the ledger).
    """

    def __init__(self, routes: Mapping[str, RouteConfig], config: AdmissionConfig | None = None, *,
                 engine_slots: Mapping[str, int] | None = None, clock: Callable[[], float] = time.monotonic):
        self.routes = routes
        self.config = config or AdmissionConfig()
        # decode slots per engine (its max_num_seqs): a request waits for one when they are all taken
        self.engine_slots = dict(engine_slots or {})
        self.clock = clock
        self._engines: dict[str, _EngineBacklog] = {}
        self._waiting: dict[str, _Waiting] = {}
        self._running: dict[str, tuple[str, float]] = {}  # request id -> (engine, first token time)
        self._route_waiting: dict[str, int] = {}
        self.decisions: collections.Counter[str] = collections.Counter()  # "route/action/reason" -> count
        self._queued_read: tuple[str, int, int, float | None] | None = None  # the last predicted_ttft's reading

    # ---- reading the state -------------------------------------------------------------------------------
    def _backlog(self, engine: str) -> _EngineBacklog:
        backlog = self._engines.get(engine)
        if backlog is None:
            backlog = self._engines[engine] = _EngineBacklog(self.clock())
        return backlog

    def prefill_rate(self, engine: str) -> float | None:
        """Measured prefill drain rate of `engine` in tokens/s (None until enough first tokens were seen)."""
        backlog = self._backlog(engine)
        backlog.advance(self.clock(), self.config.rate_halflife_s)
        return backlog.rate(self.config.min_rate_observations)

    def _slot_wait(self, engine: str, backlog: _EngineBacklog, priority: int) -> float:
        """Seconds until a decode slot frees for a new request: the requests of its class or better that wait
        ahead of it each need one first; slots turn over at slots / (mean time a request holds one)."""
        slots = self.engine_slots.get(engine)
        if not slots:
            return 0.0
        hold = backlog.decode_s.mean
        if hold is None:
            return 0.0
        to_free = backlog.num_running + backlog.requests_ahead(priority) + 1 - slots
        return max(0, to_free) * hold / slots

    def queued_ttft(self, engine: str, priority: int, prompt_tokens: int) -> float | None:
        """Seconds until a new request's first token on `engine` if only the work queued ahead of it now ran
        first (None while its rates are unmeasured)."""
        rate = self.prefill_rate(engine)
        if rate is None:
            return None
        backlog = self._backlog(engine)
        return max((backlog.tokens_ahead(priority) + prompt_tokens) / rate, self._slot_wait(engine, backlog, priority))

    def predicted_ttft(self, engine: str, priority: int, prompt_tokens: int) -> float | None:
        """`queued_ttft` times the measured stretch of the class: how much longer its recent first tokens took
        than their queue predicted (work that arrived later with a higher priority ran first)."""
        queued = self.queued_ttft(engine, priority, prompt_tokens)
        self._queued_read = (engine, priority, prompt_tokens, queued)  # what `admit` books, unless read again
        if queued is None:
            return None
        s = self.config
        return queued * self._backlog(engine).stretch(priority, s.min_rate_observations, self.clock(),
                                                      s.rate_halflife_s)

    def num_waiting(self, route: str | None = None) -> int:
        """Requests admitted and still waiting for their first token (one route, or all)."""
        return len(self._waiting) if route is None else self._route_waiting.get(route, 0)

    def waiting_by_engine(self) -> dict[str, int]:
        return {name: b.num_waiting for name, b in self._engines.items()}

    def prediction_stats(self) -> dict[str, dict[str, dict[str, float | int]]]:
        """Predicted vs actual TTFT per engine and priority since start: count, mean error (actual - predicted),
        mean absolute error, share within max(20%, 50 ms), share whose actual TTFT missed its target."""
        return {name: {str(p): e.summary() for p, e in sorted(b.errors.items())} for name, b in self._engines.items()}

    def prediction_pairs(self, engine: str, priority: int) -> list[tuple[float, float]]:
        """The latest (predicted, actual) TTFT pairs of one engine and priority, oldest first."""
        errors = self._backlog(engine).errors.get(priority)
        return list(errors.pairs) if errors else []

    def stats(self) -> dict[str, object]:
        """The ledger and the measurements behind the predictions (for `GET /v1/routes` and benchmarks)."""
        engines = {}
        for name, b in self._engines.items():
            engines[name] = {"waiting": b.num_waiting, "running": b.num_running,
                             "prefill_rate_tok_s": self.prefill_rate(name), "slot_hold_s": b.decode_s.mean,
                             "slots": self.engine_slots.get(name)}
        return {"engines": engines, "prediction": self.prediction_stats(), "decisions": dict(self.decisions)}

    # ---- deciding ----------------------------------------------------------------------------------------
    def decide(self, route: str, engine: str, prompt_tokens: int, *, pinned: bool = False) -> AdmissionDecision:
        """The verdict for a request of `route` that routing sent to `engine`; changes no state. `pinned`: only
        that engine may serve it (an embedding: another model's vectors are another space), never a downgrade."""
        cfg = self.routes.get(route)
        s = self.config
        priority = cfg.priority if cfg is not None else 0
        ttft_ms = cfg.slo.ttft_ms if cfg is not None else None
        target = ttft_ms / 1000.0 if ttft_ms is not None else None
        limit = cfg.max_waiting if cfg is not None and cfg.max_waiting is not None else s.max_waiting_per_route
        predicted = self.predicted_ttft(engine, priority, prompt_tokens)

        if self._route_waiting.get(route, 0) >= limit:
            return self._shed("queue_full", engine, priority, predicted, target, 0.0)
        if target is None:
            return AdmissionDecision(action="admit", engine=engine, reason="no_slo", predicted_ttft_s=predicted)
        if predicted is None:
            return AdmissionDecision(action="admit", engine=engine, reason="warming_up", target_ttft_s=target)
        budget = s.ttft_slack * target
        if predicted <= budget:
            return AdmissionDecision(action="admit", engine=engine, reason="within_slo",
                                     predicted_ttft_s=predicted, target_ttft_s=target)
        small = cfg.engines[0] if cfg is not None and len(cfg.engines) > 1 else None
        if cfg is not None and cfg.allow_downgrade and not pinned and small is not None and small != engine:
            on_small = self.predicted_ttft(small, priority, prompt_tokens)
            if on_small is not None and on_small <= budget:
                return AdmissionDecision(action="downgrade", engine=small, reason="small_meets_slo",
                                         predicted_ttft_s=on_small, target_ttft_s=target)
        if self._nothing_ahead(engine, priority):
            # Nothing of its class is ahead and a slot is free: shedding cannot make it faster later.
            return AdmissionDecision(action="admit", engine=engine, reason="slo_unreachable",
                                     predicted_ttft_s=predicted, target_ttft_s=target)
        return self._shed("slo_miss", engine, priority, predicted, target, budget)

    def _nothing_ahead(self, engine: str, priority: int) -> bool:
        backlog = self._backlog(engine)
        if backlog.tokens_ahead(priority) > 0:
            return False
        slots = self.engine_slots.get(engine)
        return not slots or backlog.num_running < slots

    def retry_after_s(self, route: str, engine: str) -> float:
        """Retry-After for a request of `route` on `engine` that is answered 503 now (shed, or dropped late)."""
        cfg = self.routes.get(route)
        priority = cfg.priority if cfg is not None else 0
        target = cfg.slo.ttft_ms / 1000.0 if cfg is not None and cfg.slo.ttft_ms is not None else 0.0
        return self._retry_after(self.predicted_ttft(engine, priority, 0), self.config.ttft_slack * target)

    def _retry_after(self, predicted: float | None, budget_s: float) -> float:
        """Seconds until the queue ahead should have drained enough for a new request to fit its budget."""
        s = self.config
        if predicted is None:
            wait = s.min_retry_after_s
        elif math.isinf(predicted):
            wait = s.max_retry_after_s
        else:
            wait = predicted - budget_s
        return float(math.ceil(min(s.max_retry_after_s, max(s.min_retry_after_s, wait))))

    def _shed(self, reason: str, engine: str, priority: int, predicted: float | None, target: float | None,
              budget_s: float) -> AdmissionDecision:
        """503 with Retry-After: the time for the queue ahead to drain until this request would fit."""
        return AdmissionDecision(action="shed", engine=None, reason=reason, predicted_ttft_s=predicted,
                                 target_ttft_s=target, retry_after_s=self._retry_after(predicted, budget_s),
                                 status=503)

    # ---- the ledger --------------------------------------------------------------------------------------
    def admit(self, request_id: str, route: str, engine: str, prompt_tokens: int, *, pinned: bool = False
              ) -> AdmissionDecision:
        """`decide`, and when admitted (or downgraded) book the request on the engine the verdict names."""
        self._check_new(request_id)
        self._queued_read = None
        decision = self.decide(route, engine, prompt_tokens, pinned=pinned)
        self.decisions[f"{route}/{decision.action}/{decision.reason}"] += 1
        if decision.admitted:
            booked, cfg = decision.engine or engine, self.routes.get(route)
            read = self._queued_read  # the verdict's own reading of the queue, when it was of the booked engine
            key = (booked, cfg.priority if cfg is not None else 0, prompt_tokens)
            queued = read[3] if read is not None and read[:3] == key else self.queued_ttft(*key)
            self._enter(request_id, route, booked, prompt_tokens, decision.predicted_ttft_s,
                        decision.target_ttft_s, queued)
        return decision

    def book(self, request_id: str, route: str, engine: str, prompt_tokens: int) -> None:
        """Enter a request in `engine`'s backlog without a verdict: the second engine of a request admitted
        already (a cascade's escalation)."""
        self._check_new(request_id)
        cfg = self.routes.get(route)
        priority = cfg.priority if cfg is not None else 0
        target = cfg.slo.ttft_ms / 1000.0 if cfg is not None and cfg.slo.ttft_ms is not None else None
        self._enter(request_id, route, engine, prompt_tokens, self.predicted_ttft(engine, priority, prompt_tokens),
                    target, self.queued_ttft(engine, priority, prompt_tokens))

    def _check_new(self, request_id: str) -> None:
        if request_id in self._waiting or request_id in self._running:
            raise ValueError(f"request {request_id!r} was already admitted")

    def _enter(self, request_id: str, route: str, engine: str, prompt_tokens: int, predicted: float | None,
               target: float | None, queued: float | None) -> None:
        """Book the request; `queued`: its queued TTFT, read before it joins the ledger."""
        cfg = self.routes.get(route)
        priority = cfg.priority if cfg is not None else 0
        now = self.clock()
        backlog = self._backlog(engine)
        backlog.advance(now, self.config.rate_halflife_s)
        backlog.add(priority, prompt_tokens)
        self._waiting[request_id] = _Waiting(route, engine, priority, prompt_tokens, now, predicted, target,
                                             queued_s=queued)
        self._route_waiting[route] = self._route_waiting.get(route, 0) + 1

    def first_token(self, request_id: str) -> None:
        """The request's prefill is done: its tokens leave the backlog and count toward the drain rate, its
        TTFT is checked against the prediction made at admission, and it holds a decode slot until released."""
        entry = self._leave(request_id, credit=True)
        if entry is None:
            return
        now = self.clock()
        backlog = self._engines[entry.engine]
        backlog.num_running += 1
        self._running[request_id] = (entry.engine, now)
        actual = now - entry.admitted_at
        if entry.predicted_s is not None and not math.isinf(entry.predicted_s):
            errors = backlog.errors.get(entry.priority)
            if errors is None:
                errors = backlog.errors[entry.priority] = _PredictionErrors()
            errors.observe(entry.predicted_s, actual, entry.target_s)
        if entry.queued_s is not None and not math.isinf(entry.queued_s):
            halflife = self.config.rate_halflife_s
            backlog.actual_s.setdefault(entry.priority, _Decayed(now)).add(now, halflife, actual)
            backlog.queued_s.setdefault(entry.priority, _Decayed(now)).add(now, halflife, entry.queued_s)

    def release(self, request_id: str) -> None:
        """The request ended (finished, aborted, failed, dropped), before or after its first token; idempotent."""
        if self._leave(request_id, credit=False) is not None:
            return
        held = self._running.pop(request_id, None)
        if held is None:
            return
        engine, since = held
        backlog = self._engines[engine]
        backlog.num_running -= 1
        now = self.clock()
        backlog.decode_s.add(now, self.config.rate_halflife_s, now - since)

    def _leave(self, request_id: str, *, credit: bool) -> _Waiting | None:
        entry = self._waiting.pop(request_id, None)
        if entry is None:
            return None
        backlog = self._engines[entry.engine]
        backlog.advance(self.clock(), self.config.rate_halflife_s)
        backlog.drop(entry.priority, entry.tokens)
        if credit:
            backlog.credited_tokens += entry.tokens
            backlog.observations += 1
        left = self._route_waiting[entry.route] - 1
        if left:
            self._route_waiting[entry.route] = left
        else:
            del self._route_waiting[entry.route]
        return entry
