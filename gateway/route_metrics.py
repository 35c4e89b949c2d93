"""The routes' live routing state at scrape time: each router or cascade route's `RouteMonitor` (threshold, the
target it holds, the realised large or escalated share, score quantiles and drift) and its shadow labelling
(runs, token cost, agreement) as Prometheus families, and `routing_reports`, what /v1/routes and the dashboard
show of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.metrics import BY_NAME
from gateway.route_monitor import SUMMARY_QUANTILES, RouteMonitor
from gateway.shadow import OUTCOMES


def route_monitors(strategies: Mapping[str, Any]) -> dict[str, RouteMonitor]:
    """Route name -> its monitor, for the strategies that keep one (router and cascade)."""
    return {name: s.monitor for name, s in strategies.items() if isinstance(getattr(s, "monitor", None), RouteMonitor)}


def routing_reports(strategies: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Route name -> its monitor's report plus its shadow labelling's counts (None where it has none)."""
    out = {}
    for name, monitor in route_monitors(strategies).items():
        shadow = getattr(strategies[name], "shadow", None)
        out[name] = monitor.report() | {"shadow": shadow.stats() if shadow is not None else None}
    return out


class RouteMonitorCollector(Collector):
    """The `router_*` gauges of gateway/metrics.py, read from the monitors on each scrape."""

    def __init__(self, prefix: str, strategies: Callable[[], Mapping[str, Any]]):
        self.prefix = prefix
        self.strategies = strategies

    def _family(self, name: str, factory: type = GaugeMetricFamily) -> Any:
        spec = BY_NAME[name]
        return factory(spec.exported(self.prefix), spec.doc, labels=list(spec.labels))

    def collect(self) -> Iterable[GaugeMetricFamily]:
        threshold, target, realised = (self._family(n) for n in (
            "router_threshold", "router_target_large_fraction", "router_realised_large_fraction"))
        quantiles, ks, warning = (self._family(n) for n in (
            "router_score_quantile", "router_score_drift_ks", "router_score_drift_warning"))
        strategies = self.strategies()
        acceptance = self._family("cascade_escalation_acceptance")
        for route, m in route_monitors(strategies).items():
            accepted = m.acceptance()
            if accepted is not None:
                acceptance.add_metric([route], accepted)
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
        yield from (threshold, target, realised, quantiles, ks, warning, acceptance)
        runs = self._family("router_shadow_runs", CounterMetricFamily)
        tokens = self._family("router_shadow_tokens", CounterMetricFamily)
        agreement = self._family("router_shadow_agreement")
        for route, s in strategies.items():
            shadow = getattr(s, "shadow", None)
            if shadow is None:
                continue
            stats = shadow.stats()
            for outcome in OUTCOMES:
                runs.add_metric([route, outcome], float(stats[outcome]))
            for engine in shadow.pair:
                tokens.add_metric([engine, route], float(stats["tokens"].get(engine, 0)))
            if stats["first_line_agreement"] is not None:
                agreement.add_metric([route], stats["first_line_agreement"])
        yield from (runs, tokens, agreement)
