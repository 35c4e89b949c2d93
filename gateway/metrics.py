"""The catalog of every Prometheus metric the gateway exports: name (without the `[telemetry] metric_prefix`),
type, labels, buckets and meaning. gateway/telemetry.py builds its metrics from it and docs/metrics.md is
rendered from it (`python -m gateway.metrics > docs/metrics.md`; a test compares both with a live registry).

The names, labels and histogram buckets follow vLLM's (vllm/v1/metrics/loggers.py), so `metric_prefix = "vllm"`
makes vLLM's own Grafana dashboard and alerts read tandem unchanged. `model_name` is the engine that served
the request (vLLM's `model_name`); `route` is tandem's route (the `model` the client asked for).
"""

from __future__ import annotations

import bisect
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

# vLLM's buckets, so dashboards built for vLLM read tandem's histograms unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
DEFAULT_PREFIX = "tandem"
PREFIX_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
TOKENS_1_2_5 = "1-2-5 series up to the engine's max_model_len"


def buckets_1_2_5(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... while <= `limit` (vLLM's token-count buckets)."""
    out, magnitude = [], 1
    while True:
        for step in (1, 2, 5):
            value = step * magnitude
            if value > limit:
                return tuple(float(v) for v in out)
            out.append(value)
        magnitude *= 10


@dataclass(frozen=True)
class MetricSpec:
    name: str  # without the prefix; counters without `_total` (prometheus_client appends it)
    kind: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    doc: str
    buckets: tuple[float, ...] | str | None = None  # a histogram's bounds, or how they are chosen
    when: str = "request"  # request: observed when a request ends; scrape: read from live state on each scrape

    def exported(self, prefix: str) -> str:
        return f"{prefix}:{self.name}"

    def samples(self, prefix: str) -> list[str]:
        """The sample names this family exposes."""
        base = self.exported(prefix)
        if self.kind == "counter":
            return [base + "_total"]
        if self.kind == "histogram":
            return [base + "_bucket", base + "_sum", base + "_count"]
        return [base]


REQ = ("model_name", "route")
ENGINE = ("model_name",)
CATALOG: tuple[MetricSpec, ...] = (
    # --- latency, observed when a request ends (vLLM names and buckets)
    MetricSpec("time_to_first_token_seconds", "histogram", REQ, "Time to first token, arrival at the gateway to "
               "the first generated token.", TTFT_BUCKETS),
    MetricSpec("inter_token_latency_seconds", "histogram", REQ, "Gap between consecutive streamed token "
               "deltas.", ITL_BUCKETS),
    MetricSpec("request_time_per_output_token_seconds", "histogram", REQ, "Per request: (E2E - TTFT) / "
               "(output tokens - 1).", ITL_BUCKETS),
    MetricSpec("e2e_request_latency_seconds", "histogram", REQ, "Request arrival to its last byte.",
               REQUEST_BUCKETS),
    MetricSpec("request_queue_time_seconds", "histogram", REQ, "Time waiting in the engine queue before its "
               "first schedule.", REQUEST_BUCKETS),
    MetricSpec("request_inference_time_seconds", "histogram", REQ, "First schedule to finish (prefill + decode) "
               "in the engine.", REQUEST_BUCKETS),
    MetricSpec("request_prefill_time_seconds", "histogram", REQ, "First schedule to first token in the engine.",
               REQUEST_BUCKETS),
    MetricSpec("request_decode_time_seconds", "histogram", REQ, "First token to finish in the engine.",
               REQUEST_BUCKETS),
    # --- sizes, observed when a request ends
    MetricSpec("request_prompt_tokens", "histogram", REQ, "Prompt tokens per request.", TOKENS_1_2_5),
    MetricSpec("request_generation_tokens", "histogram", REQ, "Generated tokens per request (all its choices).",
               TOKENS_1_2_5),
    MetricSpec("request_max_num_generation_tokens", "histogram", REQ, "Per request, the most tokens any one of "
               "its choices generated.", TOKENS_1_2_5),
    MetricSpec("request_params_n", "histogram", REQ, "The request's `n` (choices).", N_BUCKETS),
    MetricSpec("request_success", "counter", REQ + ("finished_reason",), "Finished requests by finish reason "
               "(stop, length, abort, ...)."),
    MetricSpec("prompt_tokens", "counter", REQ, "Prompt tokens processed."),
    MetricSpec("generation_tokens", "counter", REQ, "Tokens generated."),
    MetricSpec("request_errors", "counter", ("route", "status"), "Requests answered with an error, by HTTP "
               "status (429 and 503 include shed requests)."),
    MetricSpec("router_decisions", "counter", ("route", "choice"), "Routing decisions of router and cascade "
               "routes, by the engine that answered."),
    MetricSpec("cascade_escalations", "counter", ("route",), "Cascade escalations to the large engine."),
    # --- engine state, read from each engine's stats() at scrape time
    MetricSpec("num_requests_running", "gauge", ENGINE, "Requests in the running batch.", when="scrape"),
    MetricSpec("num_requests_waiting", "gauge", ENGINE, "Requests waiting to be scheduled.", when="scrape"),
    MetricSpec("kv_cache_usage_perc", "gauge", ENGINE, "Fraction of the shared KV pool in use (0..1).",
               when="scrape"),
    MetricSpec("prefix_cache_queries", "counter", ENGINE, "Prompt tokens looked up in the prefix cache.",
               when="scrape"),
    MetricSpec("prefix_cache_hits", "counter", ENGINE, "Prompt tokens found in the prefix cache.", when="scrape"),
    MetricSpec("num_preemptions", "counter", ENGINE, "Requests preempted (recomputed later).", when="scrape"),
    MetricSpec("spec_decode_num_draft_tokens", "counter", ENGINE, "Speculative draft tokens proposed.",
               when="scrape"),
    MetricSpec("spec_decode_num_accepted_tokens", "counter", ENGINE, "Speculative draft tokens accepted.",
               when="scrape"),
    # --- routes: SLOs, admission and cost over the sliding window ([telemetry] slo_window_s), at scrape time
    MetricSpec("slo_target_seconds", "gauge", ("route", "kind"), "The route's SLO target (kind ttft or tpot), "
               "from [routes.X] slo.", when="scrape"),
    MetricSpec("slo_attainment", "gauge", ("route", "kind"), "Share of served requests meeting the route's SLO "
               "over the window (kind ttft, tpot, or combined: every target).", when="scrape"),
    MetricSpec("goodput_share", "gauge", ("route",), "Share of all the route's requests in the window (served, "
               "shed and failed) that met every target.", when="scrape"),
    MetricSpec("goodput_requests", "gauge", ("route",), "Requests in the window that met every target (a "
               "rate: divide by [telemetry] slo_window_s).", when="scrape"),
    MetricSpec("route_requests_shed", "gauge", ("route",), "Requests shed by admission control in the window.",
               when="scrape"),
    MetricSpec("route_requests_waiting", "gauge", ("route",), "Requests of the route admitted and waiting for "
               "their first token (admission control's queue).", when="scrape"),
    MetricSpec("cost_per_1k_tokens", "gauge", ("route",), "Device cost per 1,000 tokens (prompt + completion) "
               "over the window, from [cost] price_per_device_hour.", when="scrape"),
    # --- router and cascade routes over their last `router.window` decisions (gateway/route_monitor.py)
    MetricSpec("router_threshold", "gauge", ("route",), "The score threshold the route's next decision uses (a "
               "cascade's: its escalation threshold); with a held target it follows the recent scores.",
               when="scrape"),
    MetricSpec("router_target_large_fraction", "gauge", ("route",), "The large share the route's threshold "
               "holds on its recent scores (router routes with target_large_fraction and hold_target).",
               when="scrape"),
    MetricSpec("router_realised_large_fraction", "gauge", ("route",), "Share of the route's recent decisions "
               "that went large (a cascade: that escalated), as the router decided (before any downgrade).",
               when="scrape"),
    MetricSpec("router_score_quantile", "gauge", ("route", "quantile"), "Quantiles (0.1, 0.5, 0.9) of the "
               "route's recent router (or escalation scorer) scores.", when="scrape"),
    MetricSpec("router_score_drift_ks", "gauge", ("route",), "Kolmogorov-Smirnov distance of the recent scores "
               "from the artifact's held-out score distribution.", when="scrape"),
    MetricSpec("router_score_drift_warning", "gauge", ("route",), "1 while the recent scores have drifted from "
               "the artifact's (KS >= router.drift_min_ks and p < 0.001), else 0.", when="scrape"),
    MetricSpec("cascade_escalation_acceptance", "gauge", ("route",), "Mean share of the small answer the large "
               "model accepted over the cascade route's recent escalations (drafts verified).", when="scrape"),
    MetricSpec("router_shadow_runs", "counter", ("route", "outcome"), "Shadow pairs of a router route (both "
               "engines, greedy) by outcome: labelled, skipped_budget (shadow_max_inflight reached), failed.",
               when="scrape"),
    MetricSpec("router_shadow_tokens", "counter", ("model_name", "route"), "Tokens (prompt + generated) the "
               "route's shadow pairs cost on each engine.", when="scrape"),
    MetricSpec("router_shadow_agreement", "gauge", ("route",), "Share of the route's labelled shadow pairs "
               "whose small and large greedy answers have the same first line.", when="scrape"),
    MetricSpec("autoscale_desired_replicas", "gauge", (), "The autoscaler's desired replica count at its last "
               "evaluation (GET /v1/autoscale explains it).", when="scrape"),
    MetricSpec("autoscale_current_replicas", "gauge", (), "The replica count last reported to the autoscaler "
               "(POST /v1/autoscale; 1 until then).", when="scrape"),
)
BY_NAME = {m.name: m for m in CATALOG}


def check_prefix(prefix: str) -> str:
    if not PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"metric_prefix {prefix!r} is not a Prometheus name: letters, digits and _ only, not "
                         f"starting with a digit")
    return prefix


def sample_names(prefix: str = DEFAULT_PREFIX) -> set[str]:
    return {name for spec in CATALOG for name in spec.samples(prefix)}


class TokenHistograms(Collector):
    """Histograms of token counts whose buckets follow the engine that observed them (the 1-2-5 series up to its
    max_model_len, as vLLM builds them), which prometheus_client's Histogram (one bucket set per family) cannot
    hold. Counts live in plain lists; observations come from the event loop, scrapes from any thread."""

    def __init__(self, prefix: str, names: Iterable[str], max_len: Callable[[str], int | None]):
        self.prefix = prefix
        self.names = tuple(names)
        self.max_len = max_len
        self._series: dict[tuple[str, str, str], list[Any]] = {}  # (name, model, route) -> [bounds, counts, sum]
        self._lock = threading.Lock()

    def observe(self, name: str, model: str, route: str, value: float) -> None:
        key = (name, model, route)
        series = self._series.get(key)
        if series is None:
            bounds = buckets_1_2_5(self.max_len(model) or 2048)
            series = self._series.setdefault(key, [bounds, [0] * (len(bounds) + 1), 0.0])
        bounds, counts = series[0], series[1]
        with self._lock:
            counts[bisect.bisect_left(bounds, value)] += 1
            series[2] += value

    def collect(self) -> Iterator[HistogramMetricFamily]:
        spec = {n: BY_NAME[n] for n in self.names}
        with self._lock:
            snapshot = [(k, list(s[0]), list(s[1]), s[2]) for k, s in self._series.items()]
        for name in self.names:
            family = HistogramMetricFamily(spec[name].exported(self.prefix), spec[name].doc, labels=list(REQ))
            for (n, model, route), bounds, counts, total in snapshot:
                if n != name:
                    continue
                cumulative, running = [], 0
                for bound, count in zip([*bounds, float("inf")], counts, strict=True):
                    running += count
                    cumulative.append(("+Inf" if bound == float("inf") else _fmt(bound), running))
                family.add_metric([model, route], cumulative, total)
            yield family


def _fmt(bound: float) -> str:
    return str(float(bound))


def render_markdown(prefix: str = DEFAULT_PREFIX) -> str:
    """docs/metrics.md: every metric with its type, labels and meaning."""
    lines = [
        "# Metrics",
        "",
        "<!-- Generated by `python -m gateway.metrics > docs/metrics.md` from gateway/metrics.py; "
        "tests/gateway/test_metrics_catalog.py fails when it drifts. -->",
        "",
        "`GET /metrics` serves these in the Prometheus text format (no auth, like `/health`). Every name starts "
        f"with `[telemetry] metric_prefix` followed by a colon: `{DEFAULT_PREFIX}:` by default; with "
        "`metric_prefix = \"vllm\"` the names are exactly vLLM's (`vllm:time_to_first_token_seconds`, ...), so "
        "vLLM's Grafana dashboard and alerts work unchanged. Names, labels and histogram buckets follow vLLM's "
        "(`vllm/v1/metrics/loggers.py`). Counters expose `<name>_total`; histograms `<name>_bucket`, `_sum` and "
        "`_count`.",
        "",
        "Labels: `model_name` is the engine that served the request (vLLM's label); `route` is the route the "
        "client named in `model`; `kind` is `ttft`, `tpot` or `combined`. *When* says whether a metric is "
        "observed as each request ends (`request`) or read from live state at each scrape (`scrape`); the "
        "route gauges cover the sliding window of `[telemetry] slo_window_s`.",
        "",
        "deploy/grafana/tandem.json is a Grafana dashboard over these metrics; `GET /dashboard` is the same "
        "panels built into the gateway.",
        "",
        "| Metric | Type | Labels | When | Buckets | Meaning |",
        "|---|---|---|---|---|---|",
    ]
    for spec in CATALOG:
        if isinstance(spec.buckets, tuple):
            buckets = ", ".join(f"{b:g}" for b in spec.buckets)
        else:
            buckets = spec.buckets or ""
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "none"
        lines.append(f"| `{spec.exported(prefix)}` | {spec.kind} | {labels} | {spec.when} | {buckets} | "
                     f"{spec.doc} |")
    lines += [
        "",
        "The gateway also records the OpenTelemetry GenAI server metrics (`gen_ai.server.time_to_first_token`, "
        "`gen_ai.server.time_per_output_token`, `gen_ai.server.request.duration`) and exports them over OTLP "
        "when `OTEL_METRICS_EXPORTER` / `OTEL_EXPORTER_OTLP_*` ask for it (docs/configuration.md, Tracing).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    sys.stdout.write(render_markdown())
