"""Writes deploy/grafana/tandem.json, the Grafana dashboard over tandem's Prometheus metrics (docs/metrics.md):
per-route and per-engine TTFT/TPOT p50/p99 against the SLO lines, SLO attainment, goodput, queue depth, KV usage,
prefix-cache hit rate, routing split, escalations, speculative acceptance, cost per 1k tokens, replicas, shed
requests, token throughput and the engine phases. Import it in Grafana (Dashboards > New > Import) and pick the
Prometheus data source that scrapes tandem's `/metrics`.

    .venv/bin/python deploy/grafana/build_dashboard.py     # regenerates tandem.json (a test checks it is current)

The queries assume the default `[telemetry] metric_prefix = "tandem"`; with another prefix, pass `--prefix`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
RATE = "[$__rate_interval]"


def target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True, "instant": False,
            "editorMode": "code"}


def panel(pid: int, title: str, description: str, targets: list[tuple[str, str]], *, unit: str = "short",
          x: int, y: int, w: int = 12, h: int = 8, max_value: float | None = None) -> dict[str, Any]:
    """A time series panel; series whose legend ends in "SLO", "all" or "current" are drawn dashed."""
    defaults: dict[str, Any] = {"unit": unit, "min": 0, "color": {"mode": "palette-classic"},
                                "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 0,
                                           "showPoints": "never", "spanNulls": True}}
    if max_value is not None:
        defaults["max"] = max_value
    dashed = {"matcher": {"id": "byRegexp", "options": ".*(SLO|all|current)$"},
              "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                             {"id": "custom.lineWidth", "value": 2}]}
    return {"id": pid, "type": "timeseries", "title": title, "description": description, "datasource": DS,
            "gridPos": {"x": x, "y": y, "w": w, "h": h},
            "fieldConfig": {"defaults": defaults, "overrides": [dashed]},
            "options": {"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull"]},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "targets": [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(targets)]}


def quantiles(p: str, metric: str, by: str, selector: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le, {by}) (rate({p}:{metric}_bucket{{{selector}}}{RATE})))",
             f"{{{{{by}}}}} {name}") for q, name in ((0.5, "p50"), (0.99, "p99"))]


def dashboard(p: str = "tandem") -> dict[str, Any]:
    route, engine = 'route=~"$route"', 'model_name=~"$model_name"'
    panels = [
        panel(1, "TTFT by route", "Time to first token, p50 and p99 per route; dashed: the route's SLO target.",
              quantiles(p, "time_to_first_token_seconds", "route", route)
              + [(f'max by (route) ({p}:slo_target_seconds{{kind="ttft", {route}}})', "{{route}} SLO")],
              unit="s", x=0, y=0),
        panel(2, "TPOT by route", "Time per output token, p50 and p99 per route; dashed: the route's SLO target.",
              quantiles(p, "request_time_per_output_token_seconds", "route", route)
              + [(f'max by (route) ({p}:slo_target_seconds{{kind="tpot", {route}}})', "{{route}} SLO")],
              unit="s", x=12, y=0),
        panel(3, "TTFT by engine", "Time to first token, p50 and p99 per engine (model_name).",
              quantiles(p, "time_to_first_token_seconds", "model_name", engine), unit="s", x=0, y=8),
        panel(4, "TPOT by engine", "Time per output token, p50 and p99 per engine (model_name).",
              quantiles(p, "request_time_per_output_token_seconds", "model_name", engine), unit="s", x=12, y=8),
        panel(5, "SLO attainment", "Share of served requests meeting the route's targets over the gateway's SLO "
              "window (ttft, tpot, combined), and the goodput share (shed and failed count as misses).",
              [(f"{p}:slo_attainment{{{route}}}", "{{route}} {{kind}}"),
               (f"{p}:goodput_share{{{route}}}", "{{route}} goodput share")],
              unit="percentunit", x=0, y=16, max_value=1),
        panel(6, "Goodput", "Requests per second that met every target of their route; dashed: all finished "
              "requests per second.",
              [(f"sum by (route) (rate({p}:request_success_total{{{route}}}{RATE})) * on (route) "
                f'max by (route) ({p}:slo_attainment{{kind="combined", {route}}})', "{{route}} goodput"),
               (f"sum by (route) (rate({p}:request_success_total{{{route}}}{RATE}))", "{{route}} all")],
              unit="reqps", x=12, y=16),
        panel(7, "Queue depth", "Requests waiting for a batch slot per engine, running per engine, and admitted "
              "requests waiting for their first token per route.",
              [(f"{p}:num_requests_waiting{{{engine}}}", "{{model_name}} waiting"),
               (f"{p}:num_requests_running{{{engine}}}", "{{model_name}} running"),
               (f"{p}:route_requests_waiting{{{route}}}", "route {{route}} waiting")], x=0, y=24),
        panel(8, "KV cache usage", "Share of the shared KV pool in use.",
              [(f"max by (model_name) ({p}:kv_cache_usage_perc{{{engine}}})", "{{model_name}}")],
              unit="percentunit", x=12, y=24, max_value=1),
        panel(9, "Prefix cache hit rate", "Prompt tokens found in the prefix cache over prompt tokens looked up.",
              [(f"sum by (model_name) (rate({p}:prefix_cache_hits_total{{{engine}}}{RATE})) / "
                f"sum by (model_name) (rate({p}:prefix_cache_queries_total{{{engine}}}{RATE}))", "{{model_name}}")],
              unit="percentunit", x=0, y=32, max_value=1),
        panel(10, "Routing split", "Share of each route's decisions answered by each engine (router and cascade "
              "routes).",
              [(f"sum by (route, choice) (rate({p}:router_decisions_total{{{route}}}{RATE})) / ignoring (choice) "
                f"group_left sum by (route) (rate({p}:router_decisions_total{{{route}}}{RATE}))",
                "{{route}} → {{choice}}")], unit="percentunit", x=12, y=32, max_value=1),
        panel(11, "Cascade escalations", "Share of cascade requests escalated to the large engine, and "
              "escalations per second.",
              [(f"sum by (route) (rate({p}:cascade_escalations_total{{{route}}}{RATE})) / "
                f"sum by (route) (rate({p}:router_decisions_total{{{route}}}{RATE}))", "{{route}} share"),
               (f"sum by (route) (rate({p}:cascade_escalations_total{{{route}}}{RATE}))", "{{route}} per s")],
              unit="percentunit", x=0, y=40),
        panel(12, "Speculative acceptance", "Draft tokens accepted over draft tokens proposed, per target engine.",
              [(f"sum by (model_name) (rate({p}:spec_decode_num_accepted_tokens_total{{{engine}}}{RATE})) / "
                f"sum by (model_name) (rate({p}:spec_decode_num_draft_tokens_total{{{engine}}}{RATE}))",
                "{{model_name}}")], unit="percentunit", x=12, y=40, max_value=1),
        panel(13, "Cost per 1k tokens", "Device cost per 1,000 tokens over the SLO window, from [cost] "
              "price_per_device_hour.", [(f"{p}:cost_per_1k_tokens{{{route}}}", "{{route}}")], x=0, y=48),
        panel(14, "Replicas", "The autoscaler's desired replica count; dashed: the count last reported "
              "running (POST /v1/autoscale).",
              [(f"{p}:autoscale_desired_replicas", "desired"), (f"{p}:autoscale_current_replicas", "current")],
              x=12, y=48),
        panel(15, "Shed and failed requests", "Requests answered 429 (rate limits) or 503 (overload, shed by "
              "admission, not ready) per second, by route and status.",
              [(f'sum by (route, status) (rate({p}:request_errors_total{{status=~"429|503"}}{RATE}))',
                "{{route}} {{status}}"),
               (f"sum by (route) ({p}:route_requests_shed{{{route}}})", "{{route}} shed in SLO window")],
              x=0, y=56),
        panel(16, "Token throughput", "Prompt and generated tokens per second per engine.",
              [(f"sum by (model_name) (rate({p}:prompt_tokens_total{{{engine}}}{RATE}))", "{{model_name}} prompt"),
               (f"sum by (model_name) (rate({p}:generation_tokens_total{{{engine}}}{RATE}))",
                "{{model_name}} generation")], x=12, y=56),
        panel(17, "Engine phases (mean)", "Mean queue, prefill and decode time per request and engine.",
              [(f"sum by (model_name) (rate({p}:request_{phase}_time_seconds_sum{{{engine}}}{RATE})) / "
                f"sum by (model_name) (rate({p}:request_{phase}_time_seconds_count{{{engine}}}{RATE}))",
                f"{{{{model_name}}}} {phase}") for phase in ("queue", "prefill", "decode")], unit="s", x=0, y=64),
        panel(18, "Request sizes (p50, p99)", "Prompt and generated tokens per request.",
              [(f"histogram_quantile({q}, sum by (le) (rate({p}:request_{kind}_tokens_bucket{{{engine}}}{RATE})))",
                f"{kind} p{int(q * 100)}") for kind in ("prompt", "generation") for q in (0.5, 0.99)],
              x=12, y=64),
    ]

    def variable(name: str, query: str) -> dict[str, Any]:
        return {"name": name, "label": name, "type": "query", "datasource": DS, "query": {"query": query,
                "refId": f"{name}-values"}, "definition": query, "refresh": 2, "includeAll": True, "multi": True,
                "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "sort": 1}

    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource", "pluginId": "prometheus",
                      "pluginName": "Prometheus", "description": "The Prometheus that scrapes tandem's /metrics"}],
        "title": "tandem", "uid": "tandem-gateway", "description": "tandem gateway: SLOs, routing, engines, cost "
        "(deploy/grafana/build_dashboard.py)", "tags": ["tandem", "llm"], "editable": True, "schemaVersion": 39,
        "refresh": "10s", "time": {"from": "now-30m", "to": "now"}, "graphTooltip": 1, "panels": panels,
        "templating": {"list": [
            {"name": "DS_PROMETHEUS", "label": "data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            variable("route", f"label_values({p}:slo_target_seconds, route)"),
            variable("model_name", f"label_values({p}:num_requests_running, model_name)")]},
    }


def render(prefix: str = "tandem") -> str:
    return json.dumps(dashboard(prefix), indent=2, ensure_ascii=False) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", default="tandem", help="the server's [telemetry] metric_prefix")
    ap.add_argument("--out", default=str(HERE / "tandem.json"))
    args = ap.parse_args()
    Path(args.out).write_text(render(args.prefix))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
