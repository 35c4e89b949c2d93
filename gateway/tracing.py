"""Tracing: the OpenTelemetry tracer provider and span exporters (configured by the standard OTEL_* variables),
Litestar's plugin with a lean server-span middleware (the stable HTTP and the GenAI semantic-convention
attributes), and the child spans of a request: route decision, queue, prefill, decode, cascade escalation."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from litestar.middleware.base import AbstractMiddleware
from litestar.plugins.opentelemetry import (
    OpenTelemetryConfig,
    OpenTelemetryInstrumentationMiddleware,
    OpenTelemetryPlugin,
)
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from opentelemetry import context, propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import Status, StatusCode

from engines.outputs import RequestMetrics
from gateway.config import ConfigError, TelemetryConfig
from gateway.otel_config import entry_point_exporter, env_list, otlp_endpoint_set, otlp_protocol, resource

log = logging.getLogger("tandem.gateway")

# Generation endpoints: a shed request (429/503) answered before its body was parsed still gets its GenAI
# request attributes from the body (read here, at most this many bytes).
GENERATION_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion", "/v1/responses": "chat",
                    "/v1/messages": "chat", "/v1/embeddings": "embeddings"}
SHED_STATUSES = (429, 503)
SHED_BODY_LIMIT = 1 << 20


def span_exporters(cfg: TelemetryConfig) -> list[SpanExporter]:
    """The exporters OTEL_TRACES_EXPORTER names (otlp, console, none, or any the SDK's entry points register).
    Unset: OTLP when an OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT is set and `[telemetry] otlp` is true, else none.
    The OTLP exporter reads every OTEL_EXPORTER_OTLP_* variable itself (endpoint, headers, timeout, ...)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = env_list("OTEL_TRACES_EXPORTER")
    if names is None:
        names = ["otlp"] if cfg.otlp and otlp_endpoint_set("TRACES") else []
    exporters: list[SpanExporter] = []
    for name in names:
        if name == "none":
            continue
        if name == "console":
            exporters.append(ConsoleSpanExporter(formatter=lambda span: span.to_json(indent=None) + "\n"))
        elif name == "otlp" and otlp_protocol("TRACES") == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter())
        else:
            group_name = "otlp_proto_grpc" if name == "otlp" else name
            exporter = entry_point_exporter("opentelemetry_traces_exporter", group_name)
            if exporter is None:
                what = (f"OTEL_EXPORTER_OTLP_PROTOCOL={otlp_protocol('TRACES')!r} (http/protobuf is built in; "
                        f"grpc needs opentelemetry-exporter-otlp-proto-grpc)" if name == "otlp" else
                        f"OTEL_TRACES_EXPORTER={name!r} (expected otlp, console or none, or an installed exporter)")
                raise ConfigError(f"unsupported {what}")
            exporters.append(exporter)
    return exporters


def build_tracer_provider(cfg: TelemetryConfig) -> TracerProvider:
    """A provider named after the service, sampled per OTEL_TRACES_SAMPLER (+ _ARG; the SDK reads them), exporting
    to what OTEL_TRACES_EXPORTER names."""
    provider = TracerProvider(resource=resource(cfg))
    for exporter in span_exporters(cfg):
        provider.add_span_processor(BatchSpanProcessor(exporter))
        log.info("exporting traces with %s", type(exporter).__name__)
    return provider


def http_semconv_mode() -> tuple[bool, bool]:
    """(stable, old) HTTP attribute sets: the stable names; both with OTEL_SEMCONV_STABILITY_OPT_IN=http/dup."""
    opt_in = env_list("OTEL_SEMCONV_STABILITY_OPT_IN") or []
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
        self.provider = config.tracer_provider or trace.get_tracer_provider()
        self.stable, self.old = http_semconv_mode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not spans_reach_anyone(self.provider):
            await self.app(scope, receive, send)  # no span: the handlers see the invalid span, a no-op
            return
        await traced(self.tracer, self.stable, self.old, self.app, scope, receive, send)


async def traced(tracer: trace.Tracer, stable: bool, old: bool, app: ASGIApp, scope: Scope, receive: Receive,
                 send: Send) -> None:
    """`app` under the request's SERVER span (ServerSpanMiddleware's, and the fast path's: gateway/fast_path.py)."""
    carrier: dict[str, str] = {}
    for name, value in scope["headers"]:
        carrier[name.decode("latin-1")] = value.decode("latin-1")
    method, path = scope.get("method", ""), scope["path"]
    route = scope.get("path_template") or path
    span = tracer.start_span(f"{method} {route}", context=propagate.extract(carrier), kind=trace.SpanKind.SERVER)
    recording = span.is_recording()
    if recording:
        span.set_attributes(_http_attributes(scope, carrier, method, path, route, stable, old))
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
        await app(scope, receive_body if operation is not None else receive, send_status)
    except Exception as exc:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        if status:
            if stable:
                span.set_attribute("http.response.status_code", status)
            if old:
                span.set_attribute("http.status_code", status)
            if status >= 500:
                span.set_attribute("error.type", str(status))
                span.set_status(Status(StatusCode.ERROR))
        span.end()
        context.detach(token)


def spans_reach_anyone(provider: Any) -> bool:
    """Whether a span started from `provider` can reach anyone: an SDK provider with at least one span processor
    (an exporter, an in-memory test exporter...), not disabled, and a sampler other than always-off. Checked on
    every request (a processor may be added after start-up). The default `tandem serve` exports no traces: its
    spans would be built, sampled, filled and dropped, about 0.3 ms of CPU a request for nothing."""
    processors = getattr(getattr(provider, "_active_span_processor", None), "_span_processors", None)
    if processors is None:
        return True  # not the SDK's provider (a proxy, another SDK): assume it records
    return bool(processors) and not getattr(provider, "_disabled", False) and \
        getattr(provider, "sampler", None) is not ALWAYS_OFF


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
