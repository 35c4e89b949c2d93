"""Telemetry: OpenTelemetry tracing (Litestar's plugin with a lean server-span middleware, the stable HTTP and the
GenAI semantic-convention attributes, child spans for route decision, queue, prefill and decode), configured by
the standard OTEL_* variables; Prometheus metrics from the catalog in gateway/metrics.py (vLLM's names under
`[telemetry] metric_prefix`; engine gauges pulled from `stats()` at scrape time), and live per-route SLO attainment.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from importlib.metadata import entry_points
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
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Status, StatusCode
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engines.outputs import RequestMetrics, RequestOutput
from gateway.autoscale import signals_from
from gateway.config import ConfigError, TelemetryConfig
from gateway.metrics import BY_NAME, DEFAULT_PREFIX, MetricSpec, TokenHistograms
from gateway.slo import SLOAccounting

log = logging.getLogger("tandem.gateway")
disable_created_metrics()  # no `<name>_created` gauge beside every counter and histogram (vLLM exports none either)

# The OpenTelemetry GenAI semantic conventions' bucket advisories for the server metrics.
GENAI_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
GENAI_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
GENAI_DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]
# Generation endpoints: a shed request (429/503) answered before its body was parsed still gets its GenAI
# request attributes from the body (read here, at most this many bytes).
GENERATION_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}
SHED_STATUSES = (429, 503)
SHED_BODY_LIMIT = 1 << 20


# ------------------------------------------------------------------------------------------- tracing


def _env_list(name: str) -> list[str] | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    return [part.strip().lower() for part in raw.split(",") if part.strip()]


def _otlp_endpoint_set(signal: str) -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"))


def _otlp_protocol(signal: str) -> str:
    return (os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf").strip().lower()


def _resource(cfg: TelemetryConfig) -> Resource:
    """OTEL_RESOURCE_ATTRIBUTES, with service.name from OTEL_SERVICE_NAME, else [telemetry] service_name."""
    return Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or cfg.service_name})


def _entry_point_exporter(group: str, name: str) -> Any:
    """An exporter another installed package registers under the SDK's entry-point group (zipkin, grpc, ...)."""
    for ep in entry_points(group=group):
        if ep.name == name:
            return ep.load()()
    return None


def span_exporters(cfg: TelemetryConfig) -> list[SpanExporter]:
    """The exporters OTEL_TRACES_EXPORTER names (otlp, console, none, or any the SDK's entry points register).
    Unset: OTLP when an OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT is set and `[telemetry] otlp` is true, else none.
    The OTLP exporter reads every OTEL_EXPORTER_OTLP_* variable itself (endpoint, headers, timeout, ...)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = _env_list("OTEL_TRACES_EXPORTER")
    if names is None:
        names = ["otlp"] if cfg.otlp and _otlp_endpoint_set("TRACES") else []
    exporters: list[SpanExporter] = []
    for name in names:
        if name == "none":
            continue
        if name == "console":
            exporters.append(ConsoleSpanExporter(formatter=lambda span: span.to_json(indent=None) + "\n"))
        elif name == "otlp" and _otlp_protocol("TRACES") == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter())
        else:
            group_name = "otlp_proto_grpc" if name == "otlp" else name
            exporter = _entry_point_exporter("opentelemetry_traces_exporter", group_name)
            if exporter is None:
                what = (f"OTEL_EXPORTER_OTLP_PROTOCOL={_otlp_protocol('TRACES')!r} (http/protobuf is built in; "
                        f"grpc needs opentelemetry-exporter-otlp-proto-grpc)" if name == "otlp" else
                        f"OTEL_TRACES_EXPORTER={name!r} (expected otlp, console or none, or an installed exporter)")
                raise ConfigError(f"unsupported {what}")
            exporters.append(exporter)
    return exporters


def build_tracer_provider(cfg: TelemetryConfig) -> TracerProvider:
    """A provider named after the service, sampled per OTEL_TRACES_SAMPLER (+ _ARG; the SDK reads them), exporting
    to what OTEL_TRACES_EXPORTER names."""
    provider = TracerProvider(resource=_resource(cfg))
    for exporter in span_exporters(cfg):
        provider.add_span_processor(BatchSpanProcessor(exporter))
        log.info("exporting traces with %s", type(exporter).__name__)
    return provider


def build_meter_provider(cfg: TelemetryConfig) -> MeterProvider | None:
    """The GenAI metrics go where OTEL_METRICS_EXPORTER says (otlp, console, none; unset: OTLP when an endpoint
    variable is set); otherwise the global provider (a no-op unless the process configured one) receives them."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = _env_list("OTEL_METRICS_EXPORTER")
    if names is None:
        names = ["otlp"] if cfg.otlp and _otlp_endpoint_set("METRICS") else []
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

    readers = []
    for name in names:
        if name == "none":
            continue
        if name == "console":
            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
        elif name == "otlp" and _otlp_protocol("METRICS") == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        else:
            exporter = _entry_point_exporter("opentelemetry_metrics_exporter",
                                             "otlp_proto_grpc" if name == "otlp" else name)
            if exporter is None:
                raise ConfigError(f"unsupported OTEL_METRICS_EXPORTER={name!r} / OTEL_EXPORTER_OTLP_PROTOCOL="
                                  f"{_otlp_protocol('METRICS')!r} (built in: otlp over http/protobuf, console, none)")
            readers.append(PeriodicExportingMetricReader(exporter))
    if not readers:
        return None
    return MeterProvider(resource=_resource(cfg), metric_readers=readers)


def http_semconv_mode() -> tuple[bool, bool]:
    """(stable, old) HTTP attribute sets: the stable names; both with OTEL_SEMCONV_STABILITY_OPT_IN=http/dup."""
    opt_in = _env_list("OTEL_SEMCONV_STABILITY_OPT_IN") or []
    return True, "http/dup" in opt_in


class ServerSpanMiddleware(OpenTelemetryInstrumentationMiddleware):
    """The request's SERVER span, as the OpenTelemetry ASGI instrumentation makes it (name, kind, the stable HTTP
    semantic-convention attributes, the incoming trace context, status and exceptions), without its per-message
    wrappers and attribute collection ahead of the sampling decision: those cost about 0.1 ms of CPU on every
    request. A generation request shed with 429/503 before its handler named its model gets its GenAI request
    attributes from the body. Litestar's plugin installs it through `OpenTelemetryConfig.middleware_class`."""

    def __init__(self, app: ASGIApp, config: OpenTelemetryConfig) -> None:
        AbstractMiddleware.__init__(self, app=app, scopes=config.scopes, exclude=config.exclude,
                                    exclude_opt_key=config.exclude_opt_key)
        self.tracer = config.tracer or trace.get_tracer("tandem.gateway", tracer_provider=config.tracer_provider)
        self.stable, self.old = http_semconv_mode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        carrier: dict[str, str] = {}
        for name, value in scope["headers"]:
            carrier[name.decode("latin-1")] = value.decode("latin-1")
        method, path = scope.get("method", ""), scope["path"]
        route = scope.get("path_template") or path
        span = self.tracer.start_span(f"{method} {route}", context=propagate.extract(carrier),
                                      kind=trace.SpanKind.SERVER)
        recording = span.is_recording()
        if recording:
            span.set_attributes(_http_attributes(scope, carrier, method, path, route, self.stable, self.old))
        token = context.attach(trace.set_span_in_context(span))
        status = 0
        operation = GENERATION_PATHS.get(path) if recording and method == "POST" else None
        body: list[bytes] = []  # a generation request's body as the app reads it (references, no copies)

        async def receive_body() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                body.append(message.get("body", b""))
            return message

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if operation is not None and status in SHED_STATUSES:
                    await _shed_attributes(span, operation, body, receive)
            await send(message)

        try:
            await self.app(scope, receive_body if operation is not None else receive, send_status)
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            if status:
                if self.stable:
                    span.set_attribute("http.response.status_code", status)
                if self.old:
                    span.set_attribute("http.status_code", status)
                if status >= 500:
                    span.set_attribute("error.type", str(status))
                    span.set_status(Status(StatusCode.ERROR))
            span.end()
            context.detach(token)


async def _shed_attributes(span: trace.Span, operation: str, body: list[bytes], receive: Receive) -> None:
    """GenAI request attributes for a request answered 429/503 (rate limit, overload, not ready) whose handler did
    not set them: from the body the app read, or, when it read none (a middleware refused it), from the body read
    here (bounded). Best effort: a body that is not a JSON object sets only the operation."""
    attrs = getattr(span, "attributes", None) or {}
    if "gen_ai.request.model" in attrs:
        return
    if not body:
        size = 0
        while size <= SHED_BODY_LIMIT:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            body.append(chunk)
            size += len(chunk)
            if not message.get("more_body", False):
                break
    new: dict[str, Any] = {"gen_ai.operation.name": operation, "gen_ai.provider.name": "tandem"}
    try:
        data = json.loads(b"".join(body)) if sum(map(len, body)) <= SHED_BODY_LIMIT else None
    except ValueError:
        data = None
    if isinstance(data, dict):
        if isinstance(data.get("model"), str):
            new["gen_ai.request.model"] = data["model"]
        for field in ("temperature", "top_p", "seed", "max_tokens", "frequency_penalty", "presence_penalty"):
            value = data.get(field)
            if isinstance(value, int | float) and not isinstance(value, bool):
                new[f"gen_ai.request.{field}"] = value
        if isinstance(data.get("max_completion_tokens"), int):
            new["gen_ai.request.max_tokens"] = data["max_completion_tokens"]
    span.set_attributes(new)


def _http_attributes(scope: Scope, headers: Mapping[str, str], method: str, path: str, route: str,
                     stable: bool = True, old: bool = False) -> dict[str, Any]:
    """HTTP server span attributes: the stable semantic conventions (http.request.method, url.path, ...) and, with
    `old`, the pre-stable names the ASGI instrumentation used to set."""
    host, port = scope.get("server") or ("0.0.0.0", 80)
    query = scope["query_string"].decode("latin-1") if scope.get("query_string") else ""
    scheme = scope.get("scheme", "http")
    version = scope.get("http_version", "1.1")
    client = scope.get("client")
    attrs: dict[str, Any] = {}
    if stable:
        address, _, header_port = headers.get("host", "").partition(":")
        attrs.update({"http.request.method": method, "url.scheme": scheme, "url.path": path, "http.route": route,
                      "server.address": address or host,
                      "server.port": int(header_port) if header_port.isdigit() else port,
                      "network.protocol.version": version})
        if query:
            attrs["url.query"] = query
        if "user-agent" in headers:
            attrs["user_agent.original"] = headers["user-agent"]
        if client:
            attrs["client.address"], attrs["client.port"] = client
            attrs["network.peer.address"], attrs["network.peer.port"] = client
    if old:
        server_host = host if port == 80 else f"{host}:{port}"
        target = path + ("?" + query if query else "")
        attrs.update({"http.scheme": scheme, "http.host": server_host, "net.host.port": port,
                      "http.flavor": version, "http.target": target,
                      "http.url": f"{scheme}://{headers.get('host', server_host)}{target}", "http.method": method})
        if "host" in headers:
            attrs["http.server_name"] = headers["host"]
        if "user-agent" in headers:
            attrs["http.user_agent"] = headers["user-agent"]
        if client:
            attrs["net.peer.ip"], attrs["net.peer.port"] = client
    return attrs


def otel_plugin(provider: TracerProvider) -> OpenTelemetryPlugin:
    config = OpenTelemetryConfig(tracer_provider=provider, middleware_class=ServerSpanMiddleware,
                                 exclude=["^/metrics$", "^/health$", "^/ready$", "^/dashboard"])
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

# catalog name -> the engine stats() key it reads
ENGINE_GAUGES = {"num_requests_running": "num_running", "num_requests_waiting": "num_waiting",
                 "kv_cache_usage_perc": "kv_usage"}
ENGINE_COUNTERS = {"prefix_cache_queries": "prefix_cache_queries", "prefix_cache_hits": "prefix_cache_hits",
                   "num_preemptions": "num_preemptions", "spec_decode_num_draft_tokens": "spec_num_draft_tokens",
                   "spec_decode_num_accepted_tokens": "spec_num_accepted_tokens"}
TOKEN_HISTOGRAMS = ("request_prompt_tokens", "request_generation_tokens", "request_max_num_generation_tokens")


class _ScrapeCollector(Collector):
    """Gauges and counters read when Prometheus scrapes, not on every step: each engine's `stats()`, the routes'
    sliding-window SLO accounting, admission control's queues and the autoscaler's last decision."""

    def __init__(self, telemetry: Telemetry):
        self.t = telemetry

    def _family(self, name: str, factory: type) -> Any:
        spec: MetricSpec = BY_NAME[name]
        return factory(spec.exported(self.t.prefix), spec.doc, labels=list(spec.labels))

    def collect(self) -> Iterable[Any]:
        t = self.t
        stats = {name: engine.stats() for name, engine in t._engines().items()}
        for metric, key in ENGINE_GAUGES.items():
            family = self._family(metric, GaugeMetricFamily)
            for name, s in stats.items():
                if key in s:
                    family.add_metric([name], float(s[key]))
            yield family
        for metric, key in ENGINE_COUNTERS.items():
            family = self._family(metric, CounterMetricFamily)
            for name, s in stats.items():
                if key in s:
                    family.add_metric([name], float(s[key]))
            yield family
        for name, s in stats.items():  # busy time feeds the live cost
            if "busy_s" in s:
                t.slo.observe_engine_busy(name, float(s["busy_s"]))
        reports = t.slo.reports()
        targets = self._family("slo_target_seconds", GaugeMetricFamily)
        for route, cfg in t.slo.routes.items():
            for kind in ("ttft", "tpot"):
                target_ms = getattr(cfg.slo, f"{kind}_ms", None)
                if target_ms is not None:
                    targets.add_metric([route, kind], target_ms / 1000.0)
        yield targets
        attainment = self._family("slo_attainment", GaugeMetricFamily)
        goodput = self._family("goodput_share", GaugeMetricFamily)
        good = self._family("goodput_requests", GaugeMetricFamily)
        shed = self._family("route_requests_shed", GaugeMetricFamily)
        cost = self._family("cost_per_1k_tokens", GaugeMetricFamily)
        for route, r in reports.items():
            for kind, value in (("ttft", r.ttft.attainment), ("tpot", r.tpot.attainment), ("combined", r.attainment)):
                if value is not None:
                    attainment.add_metric([route, kind], value)
            if r.goodput_share is not None:
                goodput.add_metric([route], r.goodput_share)
            good.add_metric([route], float(round((r.attainment or 0.0) * r.requests)))
            shed.add_metric([route], float(r.shed))
            if r.cost_per_1k_tokens is not None:
                cost.add_metric([route], r.cost_per_1k_tokens)
        yield from (attainment, goodput, good, shed, cost)
        waiting = self._family("route_requests_waiting", GaugeMetricFamily)
        admission = t._admission()
        if admission is not None:
            for route in t.slo.routes:
                waiting.add_metric([route], float(admission.num_waiting(route)))
        yield waiting
        desired = self._family("autoscale_desired_replicas", GaugeMetricFamily)
        current = self._family("autoscale_current_replicas", GaugeMetricFamily)
        scaler = t._autoscaler()
        if scaler is not None:
            current.add_metric([], float(scaler.replicas))
            wanted = scaler.desired
            if wanted is None and stats:  # before the first periodic evaluation: what it would decide now
                wanted = scaler.preview(signals_from(stats, reports, scaler.replicas)).desired_replicas
            if wanted is not None:
                desired.add_metric([], float(wanted))
        yield from (desired, current)


class Telemetry:
    """The gateway's metrics registry and tracer; one per app so tests can run several. Metric names come from the
    catalog in gateway/metrics.py, under `prefix` (`[telemetry] metric_prefix`)."""

    def __init__(self, provider: TracerProvider, slo: SLOAccounting, meter_provider: MeterProviderAPI | None = None,
                 *, prefix: str = DEFAULT_PREFIX):
        self.provider = provider
        self.prefix = prefix
        self.slo = slo
        self.tracer = provider.get_tracer("tandem.gateway")
        self.registry = CollectorRegistry(auto_describe=True)
        self._engines: Callable[[], Mapping[str, Any]] = dict
        self._admission: Callable[[], Any] = lambda: None
        self._autoscaler: Callable[[], Any] = lambda: None
        self._children: dict[tuple[Any, ...], Any] = {}
        reg = self.registry

        def histogram(name: str) -> Histogram:
            spec = BY_NAME[name]
            return Histogram(spec.exported(prefix), spec.doc, list(spec.labels), buckets=spec.buckets, registry=reg)

        def counter(name: str) -> Counter:
            spec = BY_NAME[name]
            return Counter(spec.exported(prefix), spec.doc, list(spec.labels), registry=reg)

        self.ttft = histogram("time_to_first_token_seconds")
        self.itl = histogram("inter_token_latency_seconds")
        self.tpot = histogram("request_time_per_output_token_seconds")
        self.e2e = histogram("e2e_request_latency_seconds")
        self.queue = histogram("request_queue_time_seconds")
        self.inference = histogram("request_inference_time_seconds")
        self.prefill = histogram("request_prefill_time_seconds")
        self.decode = histogram("request_decode_time_seconds")
        self.params_n = histogram("request_params_n")
        self.requests = counter("request_success")
        self.prompt_tokens = counter("prompt_tokens")
        self.generation_tokens = counter("generation_tokens")
        self.errors = counter("request_errors")
        self.router_decisions = counter("router_decisions")
        self.cascade_escalations = counter("cascade_escalations")
        for route, cfg in slo.routes.items():  # known label sets start at 0, so rates exist from the start
            for engine in cfg.engines:
                self.router_decisions.labels(route, engine)
            if cfg.strategy == "cascade":
                self.cascade_escalations.labels(route)
            for status in ("429", "503"):  # rate-limited and shed
                self.errors.labels(route, status)
        self.token_histograms = TokenHistograms(prefix, TOKEN_HISTOGRAMS, self._max_model_len)
        reg.register(self.token_histograms)
        reg.register(_ScrapeCollector(self))
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

    def bind_state(self, state: Any) -> None:
        """The gateway state the scrape-time collector reads: engines, admission control, the autoscaler."""
        self._engines = lambda: state.engines
        self._admission = lambda: state.admission
        self._autoscaler = lambda: state.autoscaler

    def _max_model_len(self, model: str) -> int | None:
        engine = self._engines().get(model)
        return getattr(engine, "max_model_len", None)

    def _bound(self, model: str, route: str) -> tuple[Any, ...]:
        """The label-bound children of one (model, route), cached: `.labels()` costs on every request."""
        key = (model, route)
        bound = self._children.get(key)
        if bound is None:
            bound = self._children[key] = tuple(m.labels(model, route) for m in (
                self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.prompt_tokens, self.generation_tokens,
                self.inference, self.prefill, self.decode, self.params_n))
        return bound

    def labelled(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, cached like `_bound`."""
        child = self._children.get((metric, labels))
        if child is None:
            child = self._children[(metric, labels)] = metric.labels(*labels)
        return child

    def observe_request(self, *, route: str, model: str, ttft_s: float | None, tpot_s: float | None, e2e_s: float,
                        itls: list[float], output_tokens: int, prompt_tokens: int, finish_reason: str,
                        queue_s: float | None, operation: str = "chat", request_model: str = "",
                        output: RequestOutput | None = None) -> None:
        """One request's end. With the engine's last `output`: also its phases (prefill, decode, inference, from
        the engine's timestamps) and sizes (prompt, generated and most-per-choice tokens, n)."""
        (ttft_m, itl_m, tpot_m, e2e_m, queue_m, prompt_m, generation_m, inference_m, prefill_m, decode_m,
         n_m) = self._bound(model, route)
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
        if output is not None:
            m = output.metrics
            if m is not None and m.first_scheduled_time is not None:
                if m.first_token_time is not None:
                    prefill_m.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
                    if m.finished_time is not None:
                        decode_m.observe(max(0.0, m.finished_time - m.first_token_time))
                if m.finished_time is not None:
                    inference_m.observe(max(0.0, m.finished_time - m.first_scheduled_time))
            tokens = self.token_histograms
            tokens.observe("request_prompt_tokens", model, route, prompt_tokens)
            tokens.observe("request_generation_tokens", model, route, output_tokens)
            tokens.observe("request_max_num_generation_tokens", model, route,
                           max((len(c.token_ids) for c in output.outputs), default=0))
            n_m.observe(len(output.outputs))
        attrs = {"gen_ai.operation.name": operation, "gen_ai.provider.name": "tandem",
                 "gen_ai.request.model": request_model or route, "gen_ai.response.model": model}
        if ttft_s is not None:
            self.genai_ttft.record(ttft_s, attrs)
        if tpot_s is not None:
            self.genai_tpot.record(tpot_s, attrs)
        self.genai_duration.record(e2e_s, attrs)

    def count_error(self, route: str | None, status: int) -> None:
        self.errors.labels(route or "", str(status)).inc()
