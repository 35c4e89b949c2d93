"""The OpenTelemetry SDK's environment as tracing (gateway/tracing.py) and the GenAI metrics
(gateway/telemetry.py) both read it: OTEL_*_EXPORTER lists, the OTLP endpoint and protocol per signal, the
service resource, and exporters other packages register under the SDK's entry points."""

from __future__ import annotations

import os
from importlib.metadata import entry_points
from typing import Any

from opentelemetry.sdk.resources import Resource

from gateway.config import TelemetryConfig


def env_list(name: str) -> list[str] | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    return [part.strip().lower() for part in raw.split(",") if part.strip()]


def otlp_endpoint_set(signal: str) -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"))


def otlp_protocol(signal: str) -> str:
    return (os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf").strip().lower()


def resource(cfg: TelemetryConfig) -> Resource:
    """OTEL_RESOURCE_ATTRIBUTES, with service.name from OTEL_SERVICE_NAME, else [telemetry] service_name."""
    return Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or cfg.service_name})


def entry_point_exporter(group: str, name: str) -> Any:
    """An exporter another installed package registers under the SDK's entry-point group (zipkin, grpc, ...)."""
    for ep in entry_points(group=group):
        if ep.name == name:
            return ep.load()()
    return None
