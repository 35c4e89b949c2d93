"""`tandem loadtest` end to end against a real tandem gateway (tiny random checkpoints) on 127.0.0.1.

Checks the report's fields, that every request is accounted for, that prompt and output token counts are
exact on the server, and that the client's TTFT is never below the server's own for the same request
(matched by x-request-id against the server's trace spans) nor on average (Prometheus histogram).
"""

from __future__ import annotations

import json
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.config import config_from_dict
from gateway.server import ServerThread
from traces.cli import main as loadtest_main

# Span times come from two clocks on the server (ASGI wall clock; engine monotonic converted to wall
# clock when the span is written), so allow the conversion's jitter, far below any real TTFT here.
CLOCK_TOLERANCE_S = 0.001


@pytest.fixture(scope="module")
def gateway(tiny_checkpoint):
    small = tiny_checkpoint("llama")
    large = tiny_checkpoint("qwen2", hidden_size=96, num_heads=6, num_kv_heads=2, seed=1)
    cfg = config_from_dict({
        "engines": {"tandem-small": {"checkpoint": str(small)}, "tandem-large": {"checkpoint": str(large)}},
        "kv_pool": {"memory_bytes": 32 << 20},
        "routes": {"fast": {"engines": ["tandem-small"]}, "best": {"engines": ["tandem-large"]}}})
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    with ServerThread(cfg, tracer_provider=provider) as srv:
        yield srv, spans, small


def _server_ttft_by_request_id(spans: InMemorySpanExporter) -> dict[str, float]:
    """Request id -> server TTFT: from the request span's start to the end of its prefill span."""
    finished = spans.get_finished_spans()
    prefill_end = {s.parent.span_id: s.end_time for s in finished if s.name == "prefill" and s.parent}
    out = {}
    for s in finished:
        rid = (s.attributes or {}).get("gen_ai.response.id")
        if rid and s.context.span_id in prefill_end:
            out[rid] = (prefill_end[s.context.span_id] - s.start_time) / 1e9
    return out


def test_loadtest_against_a_real_tandem_server(gateway, tmp_path):
    srv, spans, small = gateway
    spans.clear()
    out = tmp_path / "e2e"
    rc = loadtest_main(["--url", srv.url, "--workload", "chat", "--rate", "8", "--duration", "2",
                        "--model", "fast", "--model", "best", "--tokenizer", str(small),
                        "--max-model-len", "160", "--slo", "fast:ttft=30000,tpot=10000",
                        "--slo", "best:ttft=30000,tpot=10000", "--price-per-hour", "3.0",
                        "--scrape-interval", "0.25", "--out", str(out), "--quiet"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    meta, s, server, recs = (report["metadata"], report["summary"], report["server_metrics"], report["records"])

    # Every request is accounted for, and on a healthy server every one completed.
    assert len(recs) == meta["planned_requests"] >= 8
    assert s["requests"]["sent"] == len(recs)
    assert s["requests"]["completed"] + s["requests"]["failed"] + s["requests"]["shed"] == len(recs)
    assert [r["outcome"] for r in recs] == ["completed"] * len(recs), [r["error"] for r in recs]

    # Exact lengths as the server counted them: prompt from the tokenizer, output from ignore_eos+min_tokens.
    for r in recs:
        assert r["prompt_tokens"] == r["input_tokens_target"]
        assert r["completion_tokens"] == r["output_tokens_target"]
        assert r["route"] in ("fast", "best") and r["request_id"]
    assert {r["served_model"] for r in recs} == {"tandem-small", "tandem-large"}

    # Report fields.
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(s["overall"][metric]) >= {"p50", "p90", "p95", "p99", "p99.9", "max", "mean", "count"}
        assert s["overall"][metric]["p50"] > 0
    assert set(s["per_route"]) == {"fast", "best"}
    assert s["per_route"]["fast"]["slo"]["attainment"]["combined"] == 1.0
    assert s["slo_attainment"] == 1.0 and s["goodput_rps"] == pytest.approx(len(recs) / 2.0)
    assert s["routing_split"]["tandem-small"] + s["routing_split"]["tandem-large"] == pytest.approx(1.0)
    assert s["cost"]["usd_per_1k_output_tokens"] > 0
    assert server["available"], server["reason"]
    assert server["counter_deltas"]["prefix_queries"] > 0 and server["prefix_cache_hit_rate"] is not None
    assert any("kv_usage" in x and "running" in x for x in server["series"])
    assert server["server_mean_queue_s"] is not None  # the server exposes queue time; it is reported
    assert (out / "summary.md").is_file() and (out / "latency_cdf.png").is_file()

    # Client TTFT is never below the server's for the same request.
    # the last spans end just after the last byte is sent: wait for every request's span (bounded)
    deadline = time.monotonic() + 5
    server_ttft = _server_ttft_by_request_id(spans)
    while any(r["request_id"] not in server_ttft for r in recs) and time.monotonic() < deadline:
        time.sleep(0.02)
        server_ttft = _server_ttft_by_request_id(spans)
    matched = [(r["ttft_s"], server_ttft[r["request_id"]]) for r in recs if r["request_id"] in server_ttft]
    assert len(matched) == len(recs)
    for client_ttft, srv_ttft in matched:
        assert client_ttft >= srv_ttft - CLOCK_TOLERANCE_S
    # And on average against the server's Prometheus TTFT histogram (sum/count over the run).
    client_mean = sum(r["ttft_s"] for r in recs) / len(recs)
    assert server["server_mean_ttft_s"] is not None and server["server_mean_ttft_s"] <= client_mean
