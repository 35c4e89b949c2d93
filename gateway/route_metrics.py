"""The routes' live routing state at scrape time: each router or cascade route's `RouteMonitor` (threshold, the
target it holds, the realised large or escalated share, score quantiles and drift) as Prometheus gauges, and
`route_monitors`, the one place the gateway finds those monitors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.metrics import BY_NAME
from gateway.route_monitor import SUMMARY_QUANTILES, RouteMonitor


def route_monitors(strategies: Mapping[str, Any]) -> dict[str, RouteMonitor]:
    """Route name -> its monitor, for the strategies that keep one (router and cascade)."""
    return {name: s.monitor for name, s in strategies.items() if isinstance(getattr(s, "monitor", None), RouteMonitor)}


class RouteMonitorCollector(Collector):
    """The `router_*` gauges of gateway/metrics.py, read from the monitors on each scrape."""

    def __init__(self, prefix: str, monitors: Callable[[], Mapping[str, RouteMonitor]]):
        self.prefix = prefix
        self.monitors = monitors

    def _family(self, name: str) -> GaugeMetricFamily:
        spec = BY_NAME[name]
        return GaugeMetricFamily(spec.exported(self.prefix), spec.doc, labels=list(spec.labels))

    def collect(self) -> Iterable[GaugeMetricFamily]:
        threshold, target, realised = (self._family(n) for n in (
            "router_threshold", "router_target_large_fraction", "router_realised_large_fraction"))
        quantiles, ks, warning = (self._family(n) for n in (
            "router_score_quantile", "router_score_drift_ks", "router_score_drift_warning"))
        for route, m in self.monitors().items():
            threshold.add_metric([route], m.threshold)
            if m.target_fraction is not None:
                target.add_metric([route], m.target_fraction)
            share = m.realised_fraction()
            if share is not None:
                realised.add_metric([route], share)
            for q, value in zip(SUMMARY_QUANTILES, m.quantiles().values(), strict=True):
                if value is not None:
                    quantiles.add_metric([route, f"{q:g}"], value)
            drift = m.drift()
            if drift.ks is not None:
                ks.add_metric([route], drift.ks)
                warning.add_metric([route], 1.0 if drift.warning else 0.0)
        yield from (threshold, target, realised, quantiles, ks, warning)
