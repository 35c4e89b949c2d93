"""The built-in dashboard: `GET /dashboard` is one self-contained page (gateway/static/dashboard.html: inline CSS,
JS and SVG charts, no external assets, so it works offline) that polls `GET /dashboard/data`, a JSON snapshot of
the gateway's own state: per-route SLO windows (TTFT/TPOT p50/p99 against the targets, attainment, goodput),
per-engine latency quantiles, queues, KV usage, prefix-cache, routing, escalation and speculative counters, cost,
the autoscaler's desired replicas, and each router/cascade route's held threshold, realised share and drift. Neither needs a key, like `/metrics`; neither is in the OpenAPI document.
"""

from __future__ import annotations

import time
from collections import deque
from functools import cache
from pathlib import Path
from typing import Any

from litestar import Request, Response, get
from prometheus_client import Histogram

from gateway.autoscale import signals_from
from gateway.route_metrics import routing_reports
from gateway.state import GatewayState

PAGE = Path(__file__).parent / "static" / "dashboard.html"
SNAPSHOT_EVERY_S = 5.0  # per-engine latency windows: one bucket snapshot this often, kept for slo_window_s
MAX_SNAPSHOTS = 256


@cache
def _page() -> bytes:
    return PAGE.read_bytes()


def _buckets(histogram: Histogram) -> dict[str, tuple[list[float], list[float]]]:
    """Per model_name, the histogram's cumulative bucket counts summed over routes: (upper bounds, counts)."""
    out: dict[str, dict[float, float]] = {}
    for family in histogram.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                bound = float(s.labels["le"])
                per = out.setdefault(s.labels["model_name"], {})
                per[bound] = per.get(bound, 0.0) + s.value
    return {model: (sorted(per), [per[b] for b in sorted(per)]) for model, per in out.items()}


def histogram_quantile(q: float, bounds: list[float], counts: list[float]) -> float | None:
    """Prometheus's histogram_quantile over cumulative `counts` (linear inside a bucket; the top finite bound
    when the rank falls in +Inf)."""
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


class EngineLatency:
    """Per-engine TTFT/TPOT p50/p99 over roughly the last `window_s`: the histograms' buckets now minus a snapshot
    taken about `window_s` ago (snapshots are taken as the page polls)."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.snapshots: deque[tuple[float, dict[str, Any]]] = deque(maxlen=MAX_SNAPSHOTS)

    def report(self, state: GatewayState) -> dict[str, dict[str, Any]]:
        t = state.telemetry
        now = time.monotonic()
        current = {"ttft": _buckets(t.ttft), "tpot": _buckets(t.tpot)}
        if not self.snapshots or now - self.snapshots[-1][0] >= SNAPSHOT_EVERY_S:
            self.snapshots.append((now, current))
        while len(self.snapshots) > 1 and now - self.snapshots[1][0] >= self.window_s:
            self.snapshots.popleft()
        base = self.snapshots[0][1] if now - self.snapshots[0][0] >= SNAPSHOT_EVERY_S else {}
        out: dict[str, dict[str, Any]] = {}
        for kind, per_model in current.items():
            for model, (bounds, counts) in per_model.items():
                old = base.get(kind, {}).get(model)
                if old is not None and old[0] == bounds:
                    counts = [c - o for c, o in zip(counts, old[1], strict=True)]
                entry = out.setdefault(model, {})
                p50, p99 = histogram_quantile(0.5, bounds, counts), histogram_quantile(0.99, bounds, counts)
                entry[kind] = {"count": counts[-1] if counts else 0,
                               "p50_ms": None if p50 is None else p50 * 1000.0,
                               "p99_ms": None if p99 is None else p99 * 1000.0}
        return out


def _counter(metric: Any, *keys: str) -> dict[str, float]:
    """A labelled counter's current values summed by the labels `keys` (joined with '/')."""
    out: dict[str, float] = {}
    for family in metric.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                key = "/".join(s.labels[k] for k in keys)
                out[key] = out.get(key, 0.0) + s.value
    return out


def snapshot(state: GatewayState, latency: EngineLatency) -> dict[str, Any]:
    """What the page draws, read from the gateway's own state (no scrape, no parsing)."""
    t = state.telemetry
    stats = state.engine_stats() if state.ready else {}
    reports = state.slo.reports()
    routes = []
    routing = routing_reports(state.routes.strategies)
    for name, r in reports.items():
        cfg = state.cfg.routes.get(name)
        routes.append({
            "name": name, "strategy": cfg.strategy if cfg else "engine", "engines": cfg.engines if cfg else [name],
            "requests": r.requests, "shed": r.shed, "failed": r.failed,
            "ttft": {"p50_ms": r.ttft.p50_ms, "p99_ms": r.ttft.p99_ms, "target_ms": r.ttft.target_ms,
                     "attainment": r.ttft.attainment},
            "tpot": {"p50_ms": r.tpot.p50_ms, "p99_ms": r.tpot.p99_ms, "target_ms": r.tpot.target_ms,
                     "attainment": r.tpot.attainment},
            "attainment": r.attainment, "goodput_share": r.goodput_share,
            "waiting": state.admission.num_waiting(name) if state.admission is not None else None,
            "cost_per_1k_tokens": r.cost_per_1k_tokens,
            "routing": _routing(routing[name]) if name in routing else None})
    per_engine = latency.report(state)
    engines = []
    for name, s in stats.items():
        engines.append({"name": name, "running": s.get("num_running"), "waiting": s.get("num_waiting"),
                        "kv_usage": s.get("kv_usage"), "prefix_cache_queries": s.get("prefix_cache_queries"),
                        "prefix_cache_hits": s.get("prefix_cache_hits"),
                        "spec_draft_tokens": s.get("spec_num_draft_tokens"),
                        "spec_accepted_tokens": s.get("spec_num_accepted_tokens"),
                        "preemptions": s.get("num_preemptions"), **per_engine.get(name, {})})
    scaler = state.autoscaler
    desired = scaler.desired
    if desired is None and stats:
        desired = scaler.preview(signals_from(stats, reports, scaler.replicas)).desired_replicas
    return {"time": time.time(), "ready": state.ready, "window_s": state.slo.window_s,
            "metric_prefix": t.prefix, "routes": routes, "engines": engines,
            "router_decisions": _counter(t.router_decisions, "route", "choice"),
            "escalations": _counter(t.cascade_escalations, "route"),
            "requests_total": _counter(t.requests, "route"),
            "replicas": {"desired": desired, "current": scaler.replicas}}


def _routing(r: dict[str, Any]) -> dict[str, Any]:
    """A router or cascade route's held threshold, realised share, score quantiles, drift, shadow labels and
    history."""
    return {"threshold": r["threshold"], "target_fraction": r["target_fraction"],
            "holding_target": r["holding_target"], **r["window"], "drift": r["drift"], "shadow": r["shadow"],
            "history": r["history"]}


@get("/dashboard", sync_to_thread=False, include_in_schema=False)
def dashboard() -> Response:
    return Response(_page(), media_type="text/html; charset=utf-8",
                    headers={"cache-control": "no-cache",
                             "content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; "
                             "style-src 'unsafe-inline'; connect-src 'self'; img-src data:"})


@get("/dashboard/data", sync_to_thread=False, include_in_schema=False)
def dashboard_data(request: Request) -> dict[str, Any]:
    state: GatewayState = request.app.state.gateway
    latency = request.app.state.get("dashboard_latency")
    if latency is None:
        latency = request.app.state.dashboard_latency = EngineLatency(state.slo.window_s)
    return snapshot(state, latency)


HANDLERS = [dashboard, dashboard_data]
