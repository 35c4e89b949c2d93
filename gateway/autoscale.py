"""Autoscaling signal: the desired replica count from queue depth per replica, KV-cache usage and SLO
attainment, with the reasons, and hysteresis (up at once, down only after a stabilisation window and a
cool-down, one replica at a time). Served as `GET /v1/autoscale`; KEDA or Ray Serve act on it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.slo import RouteReport


class ScaleSignals(msgspec.Struct, kw_only=True):
    """What one evaluation looks at (per-replica averages; this replica stands for the fleet)."""

    current_replicas: int  # replicas running now (from the orchestrator, or 1)
    waiting_per_replica: float  # requests waiting for a batch slot
    kv_usage: float  # 0..1, the shared KV pool's used share
    slo_attainment: dict[str, float] = msgspec.field(default_factory=dict)  # route -> share meeting its SLO
    slo_targets: dict[str, float] = msgspec.field(default_factory=dict)  # route -> share required (0.99 at p99)


class ScaleDecision(msgspec.Struct, kw_only=True):
    """The `GET /v1/autoscale` body."""

    desired_replicas: int
    current_replicas: int
    recommended_replicas: int  # before hysteresis
    utilization: float  # the largest metric/target ratio (1.0 = at target); HPA-style: replicas * utilization
    action: str  # "scale_up" | "scale_down" | "hold"
    reasons: list[str]
    signals: ScaleSignals


@dataclass
class AutoscaleSettings:
    """Targets and hysteresis (their config home: an `[autoscale]` section)."""

    min_replicas: int = 1
    max_replicas: int = 8
    target_waiting_per_replica: float = 8.0
    target_kv_usage: float = 0.8
    tolerance: float = 0.1  # ignore a metric within 10% of its target, as Kubernetes' HPA does
    max_scale_up_step: int = 4  # replicas added at most per evaluation (or doubling, whichever is more)
    slo_up_cooldown_s: float = 60.0  # an SLO miss adds one replica at most this often (attainment lags)
    down_stabilization_s: float = 300.0  # scale down to the highest recommendation of this window
    down_cooldown_s: float = 120.0  # no scale-down this soon after any change
    max_scale_down_step: int = 1


class Autoscaler:
    """Turns `ScaleSignals` into a `ScaleDecision`; keeps the hysteresis state. O(1) amortised per call."""

    def __init__(self, settings: AutoscaleSettings | None = None, *, clock: Callable[[], float] = time.monotonic):
        self.settings = settings or AutoscaleSettings()
        self.clock = clock
        self.desired: int | None = None
        self.utilization = 0.0  # of the latest recommendation
        self._last_change = -math.inf
        self._last_slo_up = -math.inf
        self._window: deque[tuple[float, int]] = deque()  # (time, recommendation), values decreasing

    def recommend(self, signals: ScaleSignals) -> tuple[int, list[str], bool]:
        """Replicas each signal asks for (the largest wins), the reasons, and whether an SLO miss asked."""
        s = self.settings
        current = max(1, signals.current_replicas)
        wanted = [s.min_replicas]
        reasons = []
        # Proportional, as Kubernetes' HPA: replicas * metric / target, ignored within the tolerance band.
        self.utilization = 0.0
        for name, value, target in (("queue", signals.waiting_per_replica, s.target_waiting_per_replica),
                                    ("kv_cache", signals.kv_usage, s.target_kv_usage)):
            ratio = value / target
            self.utilization = max(self.utilization, ratio)
            n = current if abs(ratio - 1.0) <= s.tolerance else math.ceil(current * ratio - 1e-9)
            wanted.append(n)
            if n != current:
                what = "waiting per replica" if name == "queue" else "KV usage"
                reasons.append(f"{name}: {what} {value:.3g}, target {target:.3g} -> {n}")
        missing = sorted(r for r, a in signals.slo_attainment.items() if a < signals.slo_targets.get(r, 0.0))
        slo_up = False
        if missing and (signals.waiting_per_replica > 0 or signals.kv_usage > 0):  # idle: replicas won't help
            now = self.clock()
            if now - self._last_slo_up >= s.slo_up_cooldown_s:
                slo_up = True
                wanted.append(current + 1)
                detail = ", ".join(f"{r} {signals.slo_attainment[r]:.3f} < {signals.slo_targets[r]:.3f}"
                                   for r in missing)
                reasons.append(f"slo: attainment {detail} -> {current + 1}")
            else:  # attainment is a lagging window: keep what the last SLO step bought, wait for it to show
                wanted.append(current)
                reasons.append(f"slo: attainment below target on {', '.join(missing)}; holding until the "
                               f"{s.slo_up_cooldown_s:g} s cool-down after the last SLO step")
        n = max(s.min_replicas, min(s.max_replicas, max(wanted)))
        return n, reasons, slo_up

    def evaluate(self, signals: ScaleSignals) -> ScaleDecision:
        """One evaluation: recommendation, then hysteresis against the last desired count."""
        s = self.settings
        now = self.clock()
        recommended, reasons, slo_up = self.recommend(signals)
        if self.desired is None:
            self.desired = max(s.min_replicas, min(s.max_replicas, signals.current_replicas))
        window = self._window  # sliding-window maximum of recommendations (monotonic deque)
        while window and window[-1][1] <= recommended:
            window.pop()
        window.append((now, recommended))
        while window[0][0] <= now - s.down_stabilization_s and len(window) > 1:
            window.popleft()
        stable = window[0][1]
        desired = self.desired
        action = "hold"
        if recommended > desired:
            step = max(s.max_scale_up_step, desired)
            new = min(recommended, desired + step)
            reasons.append(f"scale up {desired} -> {new} at once")
            action, desired = "scale_up", new
            if slo_up:
                self._last_slo_up = now
        elif stable < desired:
            if now - self._last_change >= s.down_cooldown_s:
                new = max(stable, desired - s.max_scale_down_step)
                reasons.append(f"scale down {desired} -> {new}: every recommendation of the last "
                               f"{s.down_stabilization_s:g} s was <= {stable}")
                action, desired = "scale_down", new
            else:
                reasons.append(f"hold {desired}: cool-down of {s.down_cooldown_s:g} s after the last change")
        elif recommended < desired:
            reasons.append(f"hold {desired}: a recommendation of {stable} within the last "
                           f"{s.down_stabilization_s:g} s")
        if desired != self.desired:
            self._last_change = now
            self.desired = desired
        if not reasons:
            reasons.append(f"hold {desired}: every signal within its target")
        return ScaleDecision(desired_replicas=desired, current_replicas=signals.current_replicas,
                             recommended_replicas=recommended, utilization=round(self.utilization, 4),
                             action=action, reasons=reasons, signals=signals)


def slo_targets(percentiles: Mapping[str, float]) -> dict[str, float]:
    """Route -> required attainment from its SLO percentile (p99 -> 0.99)."""
    return {route: p / 100.0 for route, p in percentiles.items()}


def signals_from(engine_stats: Mapping[str, Mapping[str, Any]], reports: Mapping[str, RouteReport],
                 current_replicas: int = 1) -> ScaleSignals:
    """This replica's signals from `EngineCore.stats()["engines"]` and `SLOAccounting.reports()`."""
    waiting = sum(float(s.get("num_waiting", 0)) for s in engine_stats.values())
    kv = max((float(s.get("kv_usage", 0.0)) for s in engine_stats.values()), default=0.0)  # one shared pool
    live = {name: r for name, r in reports.items() if r.attainment is not None}
    return ScaleSignals(current_replicas=current_replicas, waiting_per_replica=waiting, kv_usage=kv,
                        slo_attainment={name: r.attainment for name, r in live.items()},
                        slo_targets=slo_targets({name: r.percentile for name, r in live.items()}))
