"""Telemetry's metrics: Prometheus metrics from the catalog in gateway/metrics.py (vLLM's names under
`[telemetry] metric_prefix`; engine gauges pulled from `stats()` at scrape time), live per-route SLO attainment,
and the OpenTelemetry GenAI server histograms. `Telemetry` also holds the tracer; tracing is gateway/tracing.py.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from opentelemetry import metrics
from opentelemetry.metrics import MeterProvider as MeterProviderAPI
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.values import MutexValue

from engines.outputs import RequestOutput
from gateway.autoscale import signals_from
from gateway.config import ConfigError, TelemetryConfig
from gateway.metrics import BY_NAME, DEFAULT_PREFIX, MetricSpec, TokenHistograms
from gateway.otel_config import entry_point_exporter, env_list, otlp_endpoint_set, otlp_protocol, resource
from gateway.slo import SLOAccounting
from gateway.tracing import (  # noqa: F401 - where tests/gateway/test_otel_export.py has always imported them
    _http_attributes,
    build_tracer_provider,
    http_semconv_mode,
    span_exporters,
)

disable_created_metrics()  # no `<name>_created` gauge beside every counter and histogram (vLLM exports none either)

# The OpenTelemetry GenAI semantic conventions' bucket advisories for the server metrics.
GENAI_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
GENAI_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
GENAI_DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]


def build_meter_provider(cfg: TelemetryConfig) -> MeterProvider | None:
    """The GenAI metrics go where OTEL_METRICS_EXPORTER says (otlp, console, none; unset: OTLP when an endpoint
    variable is set); otherwise the global provider (a no-op unless the process configured one) receives them."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = env_list("OTEL_METRICS_EXPORTER")
    if names is None:
        names = ["otlp"] if cfg.otlp and otlp_endpoint_set("METRICS") else []
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

    readers = []
    for name in names:
        if name == "none":
            continue
        if name == "console":
            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
        elif name == "otlp" and otlp_protocol("METRICS") == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        else:
            exporter = entry_point_exporter("opentelemetry_metrics_exporter",
                                             "otlp_proto_grpc" if name == "otlp" else name)
            if exporter is None:
                raise ConfigError(f"unsupported OTEL_METRICS_EXPORTER={name!r} / OTEL_EXPORTER_OTLP_PROTOCOL="
                                  f"{otlp_protocol('METRICS')!r} (built in: otlp over http/protobuf, console, none)")
            readers.append(PeriodicExportingMetricReader(exporter))
    if not readers:
        return None
    return MeterProvider(resource=resource(cfg), metric_readers=readers)



# ------------------------------------------------------------------------------------------- Prometheus


def _observe(child: Any, amount: float) -> None:
    """`child.observe(amount)` for a label-bound prometheus_client Histogram child, the same sum and bucket found
    by bisection instead of its walk over every bound with a check per call (8 histograms a request)."""
    bounds = child._upper_bounds
    child._sum.inc(amount)
    i = bisect_left(bounds, amount)
    if i < len(bounds) and amount <= bounds[i]:  # NaN lands in no bucket, as with observe()
        child._buckets[i].inc(1)


class _LoopValue:
    """prometheus_client's `MutexValue` without its lock, for the request metrics' label-bound children: only the
    event loop writes them (one writer: no update is lost), and a scrape reads each float whole, as it does
    through the lock (which never made a histogram's sum and buckets one snapshot either)."""

    __slots__ = ("_value", "_exemplar")

    def __init__(self, value: float) -> None:
        self._value, self._exemplar = value, None

    def inc(self, amount: float) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def set_exemplar(self, exemplar: Any) -> None:
        self._exemplar = exemplar

    def get(self) -> float:
        return self._value

    def get_exemplar(self) -> Any:
        return self._exemplar


def _loop_only(child: Any) -> Any:
    """`child` with its values (a counter's, a histogram's sum and buckets) as `_LoopValue`s, when they are plain
    `MutexValue`s (not multiprocess files, not a prometheus_client whose fields differ)."""
    for name in ("_value", "_sum"):
        value = getattr(child, name, None)
        if type(value) is MutexValue:
            setattr(child, name, _LoopValue(value.get()))
    buckets = getattr(child, "_buckets", None)
    if isinstance(buckets, list) and all(type(b) is MutexValue for b in buckets):
        child._buckets = [_LoopValue(b.get()) for b in buckets]
    return child


def _histogram_observer(child: Any) -> Callable[[Any, float], None]:
    """`_observe` when the child has the fields it reads (prometheus_client 0.20+), else its own observe."""
    ok = all(hasattr(child, name) for name in ("_upper_bounds", "_sum", "_buckets"))
    return _observe if ok else lambda c, amount: c.observe(amount)


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
        self._observe: Callable[[Any, float], None] = _observe  # checked against the first bound child
        self._genai_attrs: dict[tuple[str, str, str], dict[str, str]] = {}
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
            bound = self._children[key] = tuple(_loop_only(m.labels(model, route)) for m in (
                self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.prompt_tokens, self.generation_tokens,
                self.inference, self.prefill, self.decode, self.params_n))
            self._observe = _histogram_observer(bound[0])
        return bound

    def labelled(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, cached like `_bound` (and written, like it, from the event loop only)."""
        child = self._children.get((metric, labels))
        if child is None:
            child = self._children[(metric, labels)] = _loop_only(metric.labels(*labels))
        return child

    def observe_request(self, *, route: str, model: str, ttft_s: float | None, tpot_s: float | None, e2e_s: float,
                        itls: list[float], output_tokens: int, prompt_tokens: int, finish_reason: str,
                        queue_s: float | None, operation: str = "chat", request_model: str = "",
                        output: RequestOutput | None = None) -> None:
        """One request's end. With the engine's last `output`: also its phases (prefill, decode, inference, from
        the engine's timestamps) and sizes (prompt, generated and most-per-choice tokens, n)."""
        (ttft_m, itl_m, tpot_m, e2e_m, queue_m, prompt_m, generation_m, inference_m, prefill_m, decode_m,
         n_m) = self._bound(model, route)
        observe = self._observe
        if ttft_s is not None:
            observe(ttft_m, ttft_s)
        for gap in itls:
            observe(itl_m, gap)
        if tpot_s is not None:
            observe(tpot_m, tpot_s)
        observe(e2e_m, e2e_s)
        if queue_s is not None:
            observe(queue_m, max(0.0, queue_s))
        self.labelled(self.requests, model, route, finish_reason).inc()
        prompt_m.inc(prompt_tokens)
        generation_m.inc(output_tokens)
        if output is not None:
            m = output.metrics
            if m is not None and m.first_scheduled_time is not None:
                if m.first_token_time is not None:
                    observe(prefill_m, max(0.0, m.first_token_time - m.first_scheduled_time))
                    if m.finished_time is not None:
                        observe(decode_m, max(0.0, m.finished_time - m.first_token_time))
                if m.finished_time is not None:
                    observe(inference_m, max(0.0, m.finished_time - m.first_scheduled_time))
            tokens = self.token_histograms
            tokens.observe("request_prompt_tokens", model, route, prompt_tokens)
            tokens.observe("request_generation_tokens", model, route, output_tokens)
            tokens.observe("request_max_num_generation_tokens", model, route,
                           max((len(c.token_ids) for c in output.outputs), default=0))
            observe(n_m, len(output.outputs))
        attrs_key = (operation, request_model or route, model)
        attrs = self._genai_attrs.get(attrs_key)
        if attrs is None:  # one dict per label set, made once and never changed (the SDK may keep it)
            attrs = self._genai_attrs[attrs_key] = {
                "gen_ai.operation.name": operation, "gen_ai.provider.name": "tandem",
                "gen_ai.request.model": attrs_key[1], "gen_ai.response.model": model}
        if ttft_s is not None:
            self.genai_ttft.record(ttft_s, attrs)
        if tpot_s is not None:
            self.genai_tpot.record(tpot_s, attrs)
        self.genai_duration.record(e2e_s, attrs)

    def count_error(self, route: str | None, status: int) -> None:
        self.errors.labels(route or "", str(status)).inc()
