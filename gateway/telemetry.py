"""Telemetry: OpenTelemetry tracing (Litestar's plugin with a lean server-span middleware, GenAI
semantic-convention attributes, child spans for route decision, queue, prefill and decode), Prometheus metrics with the names of
DESIGN section 6 (engine gauges pulled from `stats()` at scrape time), and live per-route SLO attainment.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from litestar.middleware.base import AbstractMiddleware
from litestar.plugins.opentelemetry import (
    OpenTelemetryConfig,
    OpenTelemetryInstrumentationMiddleware,
    OpenTelemetryPlugin,
)
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from opentelemetry import context, metrics, propagate, trace
from opentelemetry.metrics import MeterProvider as MeterProviderAPI
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Status, StatusCode
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engines.outputs import RequestMetrics
from gateway.config import TelemetryConfig
from gateway.slo import SLOAccounting

log = logging.getLogger("tandem.gateway")

# vLLM's buckets, so dashboards built for vLLM read tandem's histograms unchanged.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]
PREFIX = "tandem:"
# The OpenTelemetry GenAI semantic conventions' bucket advisories for the server metrics.
GENAI_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
GENAI_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
GENAI_DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]


# ------------------------------------------------------------------------------------------- tracing


def build_tracer_provider(cfg: TelemetryConfig) -> TracerProvider:
    """A provider named after the service; OTLP/HTTP export when the standard OTEL_* variables ask for it."""
    provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}))
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if cfg.otlp and endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        log.info("exporting traces over OTLP/HTTP to %s", endpoint)
    return provider


def build_meter_provider(cfg: TelemetryConfig) -> MeterProvider | None:
    """GenAI metrics go out over OTLP/HTTP when the OTEL_* variables ask for it; otherwise the global provider
    (a no-op unless the process configured one) receives them."""
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    if not (cfg.otlp and endpoint):
        return None
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    return MeterProvider(resource=Resource.create({"service.name": cfg.service_name}),
                         metric_readers=[PeriodicExportingMetricReader(OTLPMetricExporter())])


class ServerSpanMiddleware(OpenTelemetryInstrumentationMiddleware):
    """The request's SERVER span, as the OpenTelemetry ASGI instrumentation makes it (name, kind, its default
    HTTP attributes, the incoming trace context, status and exceptions), without its per-message wrappers and
    attribute collection ahead of the sampling decision: those cost about 0.1 ms of CPU on every request.
    Litestar's plugin installs it through `OpenTelemetryConfig.middleware_class`."""

    def __init__(self, app: ASGIApp, config: OpenTelemetryConfig) -> None:
        AbstractMiddleware.__init__(self, app=app, scopes=config.scopes, exclude=config.exclude,
                                    exclude_opt_key=config.exclude_opt_key)
        self.tracer = config.tracer or trace.get_tracer("tandem.gateway", tracer_provider=config.tracer_provider)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        carrier: dict[str, str] = {}
        for name, value in scope["headers"]:
            carrier[name.decode("latin-1")] = value.decode("latin-1")
        method, path = scope.get("method", ""), scope["path"]
        span = self.tracer.start_span(f"{method} {path}", context=propagate.extract(carrier),
                                      kind=trace.SpanKind.SERVER)
        if span.is_recording():
            span.set_attributes(_http_attributes(scope, carrier, method, path))
        token = context.attach(trace.set_span_in_context(span))
        status = 0

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            if status:
                span.set_attribute("http.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            span.end()
            context.detach(token)


def _http_attributes(scope: Scope, headers: Mapping[str, str], method: str, path: str) -> dict[str, Any]:
    """The ASGI instrumentation's default (pre-stable semantic conventions) HTTP server attributes."""
    host, port = scope.get("server") or ("0.0.0.0", 80)
    server_host = host if port == 80 else f"{host}:{port}"
    target = path + ("?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else "")
    scheme = scope.get("scheme", "http")
    attrs: dict[str, Any] = {"http.scheme": scheme, "http.host": server_host, "net.host.port": port,
                             "http.flavor": scope.get("http_version", "1.1"), "http.target": target,
                             "http.url": f"{scheme}://{headers.get('host', server_host)}{target}",
                             "http.method": method, "http.route": f"{method} {path}"}
    if "host" in headers:
        attrs["http.server_name"] = headers["host"]
    if "user-agent" in headers:
        attrs["http.user_agent"] = headers["user-agent"]
    if scope.get("client"):
        attrs["net.peer.ip"], attrs["net.peer.port"] = scope["client"]
    return attrs


def otel_plugin(provider: TracerProvider) -> OpenTelemetryPlugin:
    config = OpenTelemetryConfig(tracer_provider=provider, middleware_class=ServerSpanMiddleware,
                                 exclude=["^/metrics$", "^/health$", "^/ready$"])
    plugin = OpenTelemetryPlugin(config)
    plugin._middleware = config.middleware  # Litestar 2.25's plugin ignores `middleware_class` otherwise
    return plugin


def _epoch_ns(t: float, offset: float | None = None) -> int:
    """Engine timestamps are time.monotonic(); spans want wall-clock nanoseconds."""
    if t < 1e9:  # monotonic seconds since boot, not an epoch time
        t += time.time() - time.monotonic() if offset is None else offset
    return int(t * 1e9)


def add_child_span(tracer: trace.Tracer, parent: trace.Span, name: str, start_ns: int, end_ns: int,
                   attributes: Mapping[str, Any] | None = None, error: BaseException | None = None) -> None:
    """A finished child of `parent` with explicit times (no context switch), failed with `error` if given."""
    span = tracer.start_span(name, context=trace.set_span_in_context(parent), start_time=start_ns,
                             attributes=attributes)
    if error is not None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end(end_time=max(end_ns, start_ns))


def add_engine_spans(tracer: trace.Tracer, parent: trace.Span, metrics: RequestMetrics | None,
                     finished_time: float) -> None:
    """Queue, prefill and decode spans under `parent`, timed by the engine's own timestamps."""
    if metrics is None or not parent.is_recording():
        return
    offset = time.time() - time.monotonic()  # once for the three spans: they must share one clock mapping
    end = metrics.finished_time or finished_time
    decode_attrs = ({"tandem.spec.draft_tokens": metrics.num_draft_tokens,
                     "tandem.spec.accepted_tokens": metrics.num_accepted_tokens}
                    if metrics.num_draft_tokens else None)
    phases = [("queue", metrics.arrival_time, metrics.first_scheduled_time, None),
              ("prefill", metrics.first_scheduled_time, metrics.first_token_time,
               {"tandem.cached_tokens": metrics.num_cached_tokens}),
              ("decode", metrics.first_token_time, end, decode_attrs)]
    for name, start, stop, attributes in phases:
        if start is not None and stop is not None:
            add_child_span(tracer, parent, name, _epoch_ns(start, offset), _epoch_ns(stop, offset), attributes)


def add_escalation_span(tracer: trace.Tracer, parent: trace.Span, metrics: RequestMetrics | None,
                        finished_time: float, attributes: Mapping[str, Any]) -> None:
    """A cascade escalation under `parent`: from the large engine's arrival to its end, with that engine's
    queue/prefill/decode nested inside (the small attempt's phases are not re-traced)."""
    if metrics is None or not parent.is_recording():
        return
    start_ns = _epoch_ns(metrics.arrival_time)
    span = tracer.start_span("escalation", context=trace.set_span_in_context(parent), start_time=start_ns,
                             attributes=dict(attributes))
    add_engine_spans(tracer, span, metrics, finished_time)
    span.end(end_time=max(_epoch_ns(metrics.finished_time or finished_time), start_ns))


# ------------------------------------------------------------------------------------------- Prometheus


class _EngineStatsCollector(Collector):
    """Gauges and counters read from each engine's `stats()` when Prometheus scrapes, not on every step."""

    def __init__(self, engines: Callable[[], Mapping[str, Any]], slo: SLOAccounting):
        self.engines = engines
        self.slo = slo  # attainment, busy time and cost

    def collect(self) -> Iterable[Any]:
        gauges = {"num_requests_running": ("num_running", "Requests in the running batch."),
                  "num_requests_waiting": ("num_waiting", "Requests waiting to be scheduled."),
                  "kv_cache_usage_perc": ("kv_usage", "Fraction of the shared KV pool in use (0..1).")}
        counters = {"prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
                    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
                    "num_preemptions": ("num_preemptions", "Requests preempted (recomputed later)."),
                    "spec_decode_num_draft_tokens": ("spec_num_draft_tokens", "Speculative draft tokens proposed."),
                    "spec_decode_num_accepted_tokens": ("spec_num_accepted_tokens",
                                                        "Speculative draft tokens accepted.")}
        stats = {name: engine.stats() for name, engine in self.engines().items()}
        for metric, (key, doc) in gauges.items():
            family = GaugeMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            for name, s in stats.items():
                if key in s:
                    family.add_metric([name], float(s[key]))
            yield family
        for metric, (key, doc) in counters.items():
            family = CounterMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            for name, s in stats.items():
                if key in s:
                    family.add_metric([name], float(s[key]))
            yield family
        attainment = GaugeMetricFamily(PREFIX + "slo_attainment", "Share of requests meeting the route's SLO over "
                                       "the sliding window.", labels=["route", "kind"])
        for name, s in stats.items():  # busy time feeds the live cost
            if "busy_s" in s:
                self.slo.observe_engine_busy(name, float(s["busy_s"]))
        for route, kind, value in self.slo.attainment_gauges():  # kinds ttft, tpot and combined
            attainment.add_metric([route, kind], value)
        yield attainment
        cost = GaugeMetricFamily(PREFIX + "cost_per_1k_tokens", "Device cost per 1,000 tokens (prompt + "
                                 "completion) over the sliding window, from [cost] price_per_device_hour.",
                                 labels=["route"])
        for route, value in self.slo.cost_gauges():
            cost.add_metric([route], value)
        yield cost


class Telemetry:
    """The gateway's metrics registry and tracer; one per app so tests can run several."""

    def __init__(self, provider: TracerProvider, slo: SLOAccounting, meter_provider: MeterProviderAPI | None = None):
        self.provider = provider
        self.tracer = provider.get_tracer("tandem.gateway")
        self.registry = CollectorRegistry(auto_describe=True)
        self._engines: Callable[[], Mapping[str, Any]] = dict
        self._children: dict[tuple[Any, ...], Any] = {}
        labels = ["model_name", "route"]
        reg = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token (gateway view).",
                              labels, buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Gap between streamed token deltas.",
                             labels, buckets=ITL_BUCKETS, registry=reg)
        self.tpot = Histogram(PREFIX + "request_time_per_output_token_seconds", "Per request (E2E-TTFT)/(n-1).",
                              labels, buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request arrival to last byte.",
                             labels, buckets=REQUEST_BUCKETS, registry=reg)
        self.queue = Histogram(PREFIX + "request_queue_time_seconds", "Time waiting in the engine queue.",
                               labels, buckets=REQUEST_BUCKETS, registry=reg)
        self.requests = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=reg)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.", labels, registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", labels, registry=reg)
        self.errors = Counter(PREFIX + "request_errors", "Requests answered with an error, by HTTP status.",
                              ["route", "status"], registry=reg)
        self.router_decisions = Counter(PREFIX + "router_decisions", "Routing decisions by chosen engine.",
                                        ["route", "choice"], registry=reg)
        self.cascade_escalations = Counter(PREFIX + "cascade_escalations", "Cascade escalations to the large "
                                           "engine.", ["route"], registry=reg)
        reg.register(_EngineStatsCollector(lambda: self._engines(), slo))
        meter = (meter_provider or metrics.get_meter_provider()).get_meter("tandem.gateway")
        self.genai_ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s", description="Time to generate the first token.",
            explicit_bucket_boundaries_advisory=GENAI_TTFT_BUCKETS)
        self.genai_tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s", description="Time per output token after the first.",
            explicit_bucket_boundaries_advisory=GENAI_TPOT_BUCKETS)
        self.genai_duration = meter.create_histogram(
            "gen_ai.server.request.duration", unit="s", description="Generative AI server request duration.",
            explicit_bucket_boundaries_advisory=GENAI_DURATION_BUCKETS)

    def bind_engines(self, engines: Callable[[], Mapping[str, Any]]) -> None:
        """Where the scrape-time collector finds the engines (they load after the app starts)."""
        self._engines = engines

    def _bound(self, model: str, route: str) -> tuple[Any, ...]:
        """The label-bound children of one (model, route), cached: `.labels()` costs on every request."""
        key = (model, route)
        bound = self._children.get(key)
        if bound is None:
            bound = self._children[key] = tuple(m.labels(model, route) for m in (
                self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.prompt_tokens, self.generation_tokens))
        return bound

    def labelled(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, cached like `_bound`."""
        child = self._children.get((metric, labels))
        if child is None:
            child = self._children[(metric, labels)] = metric.labels(*labels)
        return child

    def observe_request(self, *, route: str, model: str, ttft_s: float | None, tpot_s: float | None, e2e_s: float,
                        itls: list[float], output_tokens: int, prompt_tokens: int, finish_reason: str,
                        queue_s: float | None, operation: str = "chat", request_model: str = "") -> None:
        ttft_m, itl_m, tpot_m, e2e_m, queue_m, prompt_m, generation_m = self._bound(model, route)
        if ttft_s is not None:
            ttft_m.observe(ttft_s)
        for gap in itls:
            itl_m.observe(gap)
        if tpot_s is not None:
            tpot_m.observe(tpot_s)
        e2e_m.observe(e2e_s)
        if queue_s is not None:
            queue_m.observe(max(0.0, queue_s))
        self.labelled(self.requests, model, route, finish_reason).inc()
        prompt_m.inc(prompt_tokens)
        generation_m.inc(output_tokens)
        attrs = {"gen_ai.operation.name": operation, "gen_ai.provider.name": "tandem",
                 "gen_ai.request.model": request_model or route, "gen_ai.response.model": model}
        if ttft_s is not None:
            self.genai_ttft.record(ttft_s, attrs)
        if tpot_s is not None:
            self.genai_tpot.record(tpot_s, attrs)
        self.genai_duration.record(e2e_s, attrs)

    def count_error(self, route: str | None, status: int) -> None:
        self.errors.labels(route or "", str(status)).inc()
