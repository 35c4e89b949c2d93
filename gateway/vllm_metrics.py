"""`/metrics` under `[telemetry] metric_prefix = "vllm"`: vLLM's own families keep vLLM's label set. Each request
family labelled by both `model_name` and `route` (gateway/metrics.py) is exported twice at scrape time: under
vLLM's name summed over routes (one line per model on vLLM's panels), and under `vllm:route_<name>` by route.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from gateway.metrics import CATALOG


class VllmLabelView(Collector):
    """The registry's families as a vLLM scrape expects them (see the module docstring)."""

    def __init__(self, registry: Any, prefix: str):
        self.registry = registry
        self.split = {spec.exported(prefix): f"{prefix}:route_{spec.name}" for spec in CATALOG
                      if "route" in spec.labels and "model_name" in spec.labels}

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            by_route = self.split.get(family.name)
            if by_route is None:
                yield family
                continue
            yield _summed_over_routes(family)
            routed = Metric(by_route, family.documentation, family.type)
            routed.samples = [s._replace(name=by_route + s.name[len(family.name):]) for s in family.samples]
            yield routed


def _summed_over_routes(family: Metric) -> Metric:
    """The family without its `route` label: values summed per remaining label set (`_created`: the earliest)."""
    out = Metric(family.name, family.documentation, family.type)
    merged: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for s in family.samples:
        key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "route")))
        if key not in merged:
            merged[key] = s.value
        elif s.name.endswith("_created"):
            merged[key] = min(merged[key], s.value)
        else:
            merged[key] += s.value
    out.samples = [Sample(name, dict(labels), value) for (name, labels), value in merged.items()]
    return out
