"""Autoscaling signal: the desired replica count from queue depth per replica, KV-cache usage and SLO
attainment, with the reasons, and hysteresis (up at once, down only after a stabilisation window and a
cool-down, one replica at a time). Only `Autoscaler.evaluate` advances the hysteresis: the gateway's own
periodic evaluation and `POST /v1/autoscale` call it; `GET /v1/autoscale` previews and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from gateway.config import AutoscaleConfig
from gateway.slo import RouteReport

log = logging.getLogger("tandem.gateway")


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


@dataclass(frozen=True)
class Hysteresis:
    """What evaluations remember: the last desired count, when it last changed, when an SLO miss last added a
    replica, and the recommendations of the stabilisation window as a sliding-window maximum."""

    desired: int | None = None
    last_change: float = -math.inf
    last_slo_up: float = -math.inf
    window: tuple[tuple[float, int], ...] = ()  # (time, recommendation), values decreasing: at most max_replicas


class Autoscaler:
    """Turns `ScaleSignals` into a `ScaleDecision`. `evaluate` advances the hysteresis; `preview` decides the
    same way and changes nothing. O(max_replicas) per call."""

    def __init__(self, settings: AutoscaleConfig | None = None, *, clock: Callable[[], float] = time.monotonic):
        self.settings = settings or AutoscaleConfig()
        self.clock = clock
        self.replicas = 1  # the orchestrator's count as last reported (POST /v1/autoscale); periodic runs use it
        self.state = Hysteresis()

    @property
    def desired(self) -> int | None:
        return self.state.desired

    def evaluate(self, signals: ScaleSignals) -> ScaleDecision:
        """One evaluation: recommendation, then hysteresis against the last desired count, remembered."""
        decision, self.state = self._decide(signals, self.state, self.clock())
        return decision

    def preview(self, signals: ScaleSignals) -> ScaleDecision:
        """What `evaluate` would decide now, without remembering it (safe to call at any rate)."""
        return self._decide(signals, self.state, self.clock())[0]

    def recommend(self, signals: ScaleSignals, state: Hysteresis, now: float
                  ) -> tuple[int, list[str], bool, float]:
        """Replicas each signal asks for (the largest wins), the reasons, whether an SLO miss asked, and the
        utilization (the largest metric/target ratio)."""
        s = self.settings
        current = max(1, signals.current_replicas)
        wanted = [s.min_replicas]
        reasons = []
        # Proportional, as Kubernetes' HPA: replicas * metric / target, ignored within the tolerance band.
        utilization = 0.0
        for name, value, target in (("queue", signals.waiting_per_replica, s.target_waiting_per_replica),
                                    ("kv_cache", signals.kv_usage, s.target_kv_usage)):
            ratio = value / target
            utilization = max(utilization, ratio)
            n = current if abs(ratio - 1.0) <= s.tolerance else math.ceil(current * ratio - 1e-9)
            wanted.append(n)
            if n != current:
                what = "waiting per replica" if name == "queue" else "KV usage"
                reasons.append(f"{name}: {what} {value:.3g}, target {target:.3g} -> {n}")
        missing = sorted(r for r, a in signals.slo_attainment.items() if a < signals.slo_targets.get(r, 0.0))
        slo_up = False
        if missing and (signals.waiting_per_replica > 0 or signals.kv_usage > 0):  # idle: replicas won't help
            if now - state.last_slo_up >= s.slo_up_cooldown_s:
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
        return n, reasons, slo_up, utilization

    def _decide(self, signals: ScaleSignals, state: Hysteresis, now: float) -> tuple[ScaleDecision, Hysteresis]:
        """The decision and the hysteresis it leaves; `state` itself is never changed."""
        s = self.settings
        recommended, reasons, slo_up, utilization = self.recommend(signals, state, now)
        if state.desired is None:
            state = replace(state, desired=max(s.min_replicas, min(s.max_replicas, signals.current_replicas)))
        # sliding-window maximum of recommendations (a monotonic deque, kept as a tuple)
        window = [entry for entry in state.window if entry[1] > recommended] + [(now, recommended)]
        while window[0][0] <= now - s.down_stabilization_s and len(window) > 1:
            window.pop(0)
        stable = window[0][1]
        desired = state.desired
        assert desired is not None
        last_slo_up = state.last_slo_up
        action = "hold"
        if recommended > desired:
            step = max(s.max_scale_up_step, desired)
            new = min(recommended, desired + step)
            reasons.append(f"scale up {desired} -> {new} at once")
            action, desired = "scale_up", new
            if slo_up:
                last_slo_up = now
        elif stable < desired:
            if now - state.last_change >= s.down_cooldown_s:
                new = max(stable, desired - s.max_scale_down_step)
                reasons.append(f"scale down {desired} -> {new}: every recommendation of the last "
                               f"{s.down_stabilization_s:g} s was <= {stable}")
                action, desired = "scale_down", new
            else:
                reasons.append(f"hold {desired}: cool-down of {s.down_cooldown_s:g} s after the last change")
        elif recommended < desired:
            reasons.append(f"hold {desired}: a recommendation of {stable} within the last "
                           f"{s.down_stabilization_s:g} s")
        if not reasons:
            reasons.append(f"hold {desired}: every signal within its target")
        after = Hysteresis(desired=desired, last_change=now if desired != state.desired else state.last_change,
                           last_slo_up=last_slo_up, window=tuple(window))
        decision = ScaleDecision(desired_replicas=desired, current_replicas=signals.current_replicas,
                                 recommended_replicas=recommended, utilization=round(utilization, 4),
                                 action=action, reasons=reasons, signals=signals)
        return decision, after


async def evaluate_periodically(scaler: Autoscaler, read_signals: Callable[[int], ScaleSignals | None],
                                interval_s: float) -> None:
    """The hysteresis's own clock: one `evaluate` every `interval_s` at the reported replica count, whoever polls
    and however often (`read_signals` gives None while there is nothing to read: the engines are loading)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            signals = read_signals(scaler.replicas)
            if signals is not None:
                scaler.evaluate(signals)
        except Exception:  # a monitor: one failed read must not stop the next evaluations
            log.exception("autoscale evaluation failed")


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
