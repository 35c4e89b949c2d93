"""Ray Serve autoscaling on tandem's own signals: a class policy (`autoscaling_config.policy.policy_function`
= `deploy.autoscale_policy:TandemAutoscalingPolicy`, its kwargs `[autoscale]` fields plus
`target_ongoing_requests`) that runs gateway.autoscale's `Autoscaler` (proportional per signal, up at once,
down after a stabilisation window and cool-down, one replica at a time) on what the replicas report through
`record_autoscaling_stats`. The Serve controller builds one instance and keeps it, hysteresis included.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from gateway.autoscale import Autoscaler, ScaleSignals
from gateway.config import AutoscaleConfig

log = logging.getLogger("ray.serve")  # the Serve controller's log


def fleet_signals(metrics: dict[str, dict[Any, float]], replicas: int, *, target_waiting: float,
                  target_ongoing: float | None) -> ScaleSignals:
    """The fleet's per-replica signals from the replicas' reports (name -> {replica: value}, averaged over the
    replicas that reported). Ongoing requests
    (running + waiting in tandem) count against the queue target in proportion, so `target_ongoing` in flight
    per replica weighs as `target_waiting` waiting; SLO headroom below 0 on any replica is an SLO miss."""
    def mean(name: str) -> float:  # over the replicas that reported: a missing report is not an idle replica
        values = metrics.get(name) or {}
        return sum(values.values()) / len(values) if values else 0.0

    waiting = mean("waiting")
    if target_ongoing:
        waiting = max(waiting, mean("ongoing") * target_waiting / target_ongoing)
    headroom = min((metrics.get("slo_headroom") or {}).values(), default=0.0)
    return ScaleSignals(current_replicas=replicas, waiting_per_replica=waiting, kv_usage=mean("kv_usage"),
                        slo_attainment={"fleet": 1.0 + min(0.0, headroom)}, slo_targets={"fleet": 1.0})


class TandemAutoscalingPolicy:
    """Called by the Serve controller with an `AutoscalingContext` each control loop; returns (replicas,
    policy state). The state carries the last decision's reasons (visible in the controller's log)."""

    def __init__(self, target_ongoing_requests: float | None = None, **autoscale: Any):
        self.target_ongoing = target_ongoing_requests
        self.settings = AutoscaleConfig(**autoscale)
        self.scaler = Autoscaler(self.settings, clock=time.monotonic)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        current = max(1, ctx.current_num_replicas)
        signals = fleet_signals(ctx.aggregated_metrics or {}, current, target_waiting=self.settings.target_waiting_per_replica,
                                target_ongoing=self.target_ongoing)
        if self.scaler.desired is not None and self.scaler.desired != ctx.target_num_replicas:
            # the controller's target moved without us (bounds, a redeploy): the hysteresis starts from it
            self.scaler.state = replace(self.scaler.state, desired=ctx.target_num_replicas)
        decision = self.scaler.evaluate(signals)
        n = max(ctx.capacity_adjusted_min_replicas, min(ctx.capacity_adjusted_max_replicas, decision.desired_replicas))
        reported = set((ctx.aggregated_metrics or {}).get("ongoing", {}))
        if n < ctx.target_num_replicas and not set(getattr(ctx, "running_replicas", reported)) <= reported:
            # a running replica sent no stats in the window (too busy to answer in time): not a reason to shrink
            n = ctx.target_num_replicas
        if n != ctx.target_num_replicas:
            log.info("tandem autoscaling %d -> %d: %s", ctx.target_num_replicas, n, "; ".join(decision.reasons))
        return n, {"reasons": decision.reasons, "utilization": decision.utilization}
