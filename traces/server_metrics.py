"""Server-side metrics during a load test: polls the endpoint's Prometheus `/metrics`, keeps time series of
queue depth and KV usage, and turns counter deltas into prefix-cache hit rate, speculative acceptance,
routing decisions and the server's own TTFT (for cross-checking the client's numbers).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

# Gauges summed over labels, except KV usage: one shared pool, so engines report the same value (take max).
GAUGES = {"waiting": "tandem:num_requests_waiting", "running": "tandem:num_requests_running",
          "kv_usage": "tandem:kv_cache_usage_perc"}
COUNTERS = {"prefix_queries": "tandem:prefix_cache_queries_total", "prefix_hits": "tandem:prefix_cache_hits_total",
            "spec_draft_tokens": "tandem:spec_decode_num_draft_tokens_total",
            "spec_accepted_tokens": "tandem:spec_decode_num_accepted_tokens_total",
            "preemptions": "tandem:num_preemptions_total", "escalations": "tandem:cascade_escalations_total",
            "ttft_sum": "tandem:time_to_first_token_seconds_sum",
            "ttft_count": "tandem:time_to_first_token_seconds_count",
            "e2e_sum": "tandem:e2e_request_latency_seconds_sum",
            "e2e_count": "tandem:e2e_request_latency_seconds_count",
            "queue_sum": "tandem:request_queue_time_seconds_sum",
            "queue_count": "tandem:request_queue_time_seconds_count"}
DECISIONS = "tandem:router_decisions_total"


def parse_metrics(text: str) -> dict[str, Any]:
    """One scrape: the tracked gauges and counters (summed over labels) and router decisions by choice, whatever
    the server's metric prefix (`tandem:`, `vllm:`, ...)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {v: k for k, v in {**GAUGES, **COUNTERS}.items()}
    out: dict[str, Any] = {}
    decisions: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name
            if ":" in name and not name.startswith("tandem:"):  # any [telemetry] metric_prefix ("vllm:", ...)
                name = "tandem:" + name.split(":", 1)[1]
            if name == DECISIONS:
                choice = s.labels.get("choice", "?")
                decisions[choice] = decisions.get(choice, 0.0) + s.value
                continue
            key = wanted.get(name)
            if key is None:
                continue
            if key == "kv_usage":
                out[key] = max(out.get(key, 0.0), s.value)
            else:
                out[key] = out.get(key, 0.0) + s.value
    if decisions:
        out["router_decisions"] = decisions
    return out


@dataclass
class MetricsScraper:
    """Polls `{base_url}/metrics` every `interval_s` while a run is going; never fails the run."""

    base_url: str
    interval_s: float = 1.0
    samples: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    async def run(self, client: httpx.AsyncClient, clock: Callable[[], float]) -> None:
        url = self.base_url.rstrip("/") + "/metrics"
        while True:
            await self.scrape_once(client, url, clock())
            await asyncio.sleep(self.interval_s)

    async def scrape_once(self, client: httpx.AsyncClient, url: str, t: float) -> None:
        try:
            resp = await client.get(url, timeout=5.0)
            if resp.status_code != 200:
                self.error = f"GET /metrics answered {resp.status_code}"
                return
            sample = parse_metrics(resp.text)
        except Exception as e:  # noqa: BLE001 - scraping is best effort; the reason goes in the report
            self.error = f"GET /metrics failed: {type(e).__name__}: {e}"[:200]
            return
        sample["t_s"] = t
        self.samples.append(sample)

    def summary(self) -> dict[str, Any]:
        """Counter deltas over the run, rates derived from them, and the time series."""
        if len(self.samples) < 2:
            return {"available": False, "reason": self.error or "fewer than two /metrics scrapes",
                    "series": self.samples}
        first, last = self.samples[0], self.samples[-1]

        def delta(key: str) -> float | None:
            if key not in last:
                return None
            return last[key] - first.get(key, 0.0)

        def ratio(num: str, den: str) -> float | None:
            n, d = delta(num), delta(den)
            return n / d if n is not None and d else None

        deltas = {k: delta(k) for k in COUNTERS}
        decisions = {}
        for choice, v in last.get("router_decisions", {}).items():
            decisions[choice] = v - first.get("router_decisions", {}).get(choice, 0.0)
        return {
            "available": True,
            "reason": self.error,
            "prefix_cache_hit_rate": ratio("prefix_hits", "prefix_queries"),
            "spec_acceptance_rate": ratio("spec_accepted_tokens", "spec_draft_tokens"),
            "server_mean_ttft_s": ratio("ttft_sum", "ttft_count"),
            "server_mean_queue_s": ratio("queue_sum", "queue_count"),
            "server_mean_e2e_s": ratio("e2e_sum", "e2e_count"),
            "counter_deltas": deltas,
            "router_decisions": decisions,
            "max_waiting": max((s.get("waiting", 0.0) for s in self.samples), default=None),
            "max_kv_usage": max((s.get("kv_usage", 0.0) for s in self.samples), default=None),
            "series": self.samples,
        }
