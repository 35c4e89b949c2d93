"""OpenTelemetry by the standard variables: spans reach a local OTLP/HTTP receiver (protobuf, decoded with
opentelemetry-proto) with OTEL_SERVICE_NAME and OTEL_EXPORTER_OTLP_HEADERS honoured, the stable HTTP
semantic-convention attributes and GenAI attributes, also on requests shed with 429 and 503;
OTEL_TRACES_EXPORTER=console prints spans from a `tandem serve` subprocess; exporter and sampler selection."""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.config import ConfigError, TelemetryConfig, config_from_dict
from gateway.server import ServerThread
from gateway.telemetry import build_tracer_provider, span_exporters

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = Path(__file__).resolve().parents[2]
SMALL = str(ROOT / "models" / "tandem-tiny-s")
MESSAGES = [{"role": "user", "content": "Say something about rivers."}]
OTEL_VARS = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
             "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_HEADERS",
             "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_SDK_DISABLED",
             "OTEL_RESOURCE_ATTRIBUTES", "OTEL_SEMCONV_STABILITY_OPT_IN", "OTEL_METRICS_EXPORTER")


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    for var in OTEL_VARS:
        monkeypatch.delenv(var, raising=False)


def _config(**extra):
    raw = {"engines": {"tandem-small": {"checkpoint": SMALL, "max_num_seqs": 8}},
           "kv_pool": {"memory_bytes": "32MiB"}, "routes": {"fast": {"engines": ["tandem-small"]}}, **extra}
    return config_from_dict(raw)


class Receiver:
    """A local OTLP/HTTP trace receiver: POST /v1/traces, protobuf (gzip or not), answers the empty response."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.headers: list[dict[str, str]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == "/v1/traces" and self.headers.get("content-type") == "application/x-protobuf"
                if ok:
                    message = ExportTraceServiceRequest()
                    message.ParseFromString(body)
                    receiver.requests.append(message)
                    receiver.headers.append({k.lower(): v for k, v in self.headers.items()})
                payload = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list[tuple[dict, object]]:
        """(resource attributes, span) for every span received."""
        out = []
        for req in self.requests:
            for rs in req.resource_spans:
                resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    out.extend((resource, span) for span in ss.spans)
        return out


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def _attrs(span) -> dict:
    return {a.key: _value(a.value) for a in span.attributes}


def _wait(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_spans_reach_an_otlp_http_receiver_with_the_standard_variables(monkeypatch):
    receiver = Receiver()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)  # the SDK appends /v1/traces
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=tandem-test")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "tandem-otlp-test")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=ci")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")  # this receiver takes traces only
    cfg = _config(auth={"api_keys": ["sk-one"], "requests_per_minute": 2})
    with ServerThread(cfg) as srv:
        headers = {"authorization": "Bearer sk-one", "user-agent": "otel-test/1"}
        ok = httpx.post(srv.url + "/v1/chat/completions?trace=1", headers=headers, timeout=60,
                        json={"model": "fast", "messages": MESSAGES, "max_tokens": 3, "temperature": 0.5})
        assert ok.status_code == 200
        assert httpx.post(srv.url + "/v1/chat/completions", headers=headers, timeout=60,
                          json={"model": "fast", "messages": MESSAGES, "max_tokens": 2}).status_code == 200
        limited = httpx.post(srv.url + "/v1/chat/completions", headers=headers, timeout=60,
                             json={"model": "fast", "messages": MESSAGES, "max_tokens": 4, "seed": 3})
        assert limited.status_code == 429  # requests/minute, refused before the body is read
        servers = lambda: [s for _, s in receiver.spans() if s.kind == s.SPAN_KIND_SERVER]  # noqa: E731
        assert _wait(lambda: len(servers()) >= 3), f"received {len(receiver.spans())} spans"
    resource, _ = receiver.spans()[0]
    assert resource["service.name"] == "tandem-otlp-test" and resource["deployment.environment"] == "ci"
    assert receiver.headers[0]["x-tenant"] == "tandem-test" and receiver.headers[0]["content-encoding"] == "gzip"
    served = next(s for s in servers() if _attrs(s).get("http.response.status_code") == 200
                  and _attrs(s).get("url.query") == "trace=1")
    a = _attrs(served)
    assert served.name == "chat fast"
    assert a["http.request.method"] == "POST" and a["url.path"] == "/v1/chat/completions"
    assert a["http.route"] == "/v1/chat/completions" and a["url.scheme"] == "http"
    assert a["server.address"] == "127.0.0.1" and a["server.port"] == srv.port
    assert a["client.address"] == "127.0.0.1" and a["user_agent.original"] == "otel-test/1"
    assert a["network.protocol.version"] == "1.1"
    assert not {"http.method", "http.status_code", "http.target", "net.peer.ip"} & set(a)  # no pre-stable names
    assert a["gen_ai.request.model"] == "fast" and a["gen_ai.response.model"] == "tandem-small"
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.usage.output_tokens"] >= 1
    children = {s.name for _, s in receiver.spans() if s.parent_span_id == served.span_id}
    assert {"route", "queue", "prefill", "decode"} <= children
    shed = next(s for s in servers() if _attrs(s).get("http.response.status_code") == 429)
    a = _attrs(shed)
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "fast"
    assert a["gen_ai.request.max_tokens"] == 4 and a["gen_ai.request.seed"] == 3
    assert "error.type" not in a  # a 4xx is the client's


def test_a_request_shed_before_the_engines_are_ready_carries_genai_attributes():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    release = threading.Event()

    def never_ready():
        release.wait(30)
        raise RuntimeError("released")

    srv = ServerThread(_config(), host_factory=never_ready, tracer_provider=provider).start(wait_ready=False)
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "fast", "prompt": "hi", "max_tokens": 7,
                                                          "top_p": 0.9}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert _wait(lambda: any(s.kind.name == "SERVER" for s in exporter.get_finished_spans()))
    finally:
        release.set()
        srv.stop()
    span = next(s for s in exporter.get_finished_spans() if s.kind.name == "SERVER")
    a = dict(span.attributes)
    assert a["http.response.status_code"] == 503 and a["error.type"] == "503"
    assert span.status.status_code.name == "ERROR"
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == "fast"
    assert a["gen_ai.request.max_tokens"] == 7 and a["gen_ai.request.top_p"] == 0.9


def test_old_http_attribute_names_only_with_the_dup_opt_in(monkeypatch):
    from gateway.telemetry import _http_attributes

    scope = {"server": ("10.0.0.2", 8000), "scheme": "http", "http_version": "1.1", "query_string": b"a=1",
             "client": ("10.0.0.9", 5555)}
    headers = {"host": "api.example:8443", "user-agent": "ua"}
    stable = _http_attributes(scope, headers, "GET", "/v1/models", "/v1/models")
    assert stable["server.address"] == "api.example" and stable["server.port"] == 8443
    assert stable["url.query"] == "a=1" and "http.method" not in stable
    both = _http_attributes(scope, headers, "GET", "/v1/models", "/v1/models", True, True)
    assert both["http.method"] == "GET" and both["http.target"] == "/v1/models?a=1"
    assert both["http.request.method"] == "GET"
    from gateway.telemetry import http_semconv_mode

    assert http_semconv_mode() == (True, False)
    monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "http/dup")
    assert http_semconv_mode() == (True, True)


def test_exporter_and_sampler_selection(monkeypatch):
    cfg = TelemetryConfig()
    assert span_exporters(cfg) == []  # nothing asked for
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    assert [type(e).__name__ for e in span_exporters(cfg)] == ["OTLPSpanExporter"]  # tandem's default
    assert span_exporters(TelemetryConfig(otlp=False)) == []
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert span_exporters(cfg) == []
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console,otlp")
    assert [type(e).__name__ for e in span_exporters(cfg)] == ["ConsoleSpanExporter", "OTLPSpanExporter"]
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin-nope")
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER='zipkin-nope'"):
        span_exporters(cfg)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with pytest.raises(ConfigError, match="grpc"):
        span_exporters(cfg)
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert span_exporters(cfg) == []
    for var in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_SDK_DISABLED",
                "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    provider = build_tracer_provider(cfg)
    assert "TraceIdRatioBased{0.25}" in provider.sampler.get_description()
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    assert not build_tracer_provider(cfg).get_tracer("t").start_span("x").is_recording()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    assert build_tracer_provider(cfg).resource.attributes["service.name"] == "from-env"
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    assert build_tracer_provider(TelemetryConfig(service_name="cfg-name")).resource.attributes[
        "service.name"] == "cfg-name"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_console_exporter_prints_spans_from_a_serve_subprocess(tmp_path):
    config = tmp_path / "tandem.toml"
    config.write_text(f'[engines.tandem-small]\ncheckpoint = "{SMALL}"\nmax_num_seqs = 4\n\n'
                      f'[kv_pool]\nmemory_bytes = "32MiB"\n\n[routes.fast]\nengines = ["tandem-small"]\n')
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TANDEM_"))}
    env.update(OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME="tandem-console", OTEL_BSP_SCHEDULE_DELAY="100",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
                             "--port", str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return httpx.get(url + "/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return proc.poll() is not None
        assert _wait(ready, timeout=120) and proc.poll() is None
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"model": "fast", "messages": MESSAGES, "max_tokens": 3})
        assert r.status_code == 200
        time.sleep(0.6)  # past the batch processor's 100 ms schedule
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    spans = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    server = next(s for s in spans if s["name"] == "chat fast")
    assert server["kind"] == "SpanKind.SERVER"
    assert server["attributes"]["http.request.method"] == "POST"
    assert server["attributes"]["http.response.status_code"] == 200
    assert server["attributes"]["gen_ai.request.model"] == "fast"
    assert server["resource"]["attributes"]["service.name"] == "tandem-console"
    assert {"queue", "prefill", "decode"} <= {s["name"] for s in spans
                                            if s["parent_id"] == server["context"]["span_id"]}
