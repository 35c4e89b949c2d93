"""Load-test metrics on hand-made records with known answers (vLLM conventions)."""

from __future__ import annotations

import numpy as np
import pytest

from traces.client import RequestRecord
from traces.metrics import Slo, highest_passing_rate, meets, parse_slo, percentiles, summarise


def rec(i, *, sent, first=None, tokens=(), end=None, outcome="completed", model="auto", route=None,
        served=None, escalated=None, completion=None, prompt=10, scheduled=None):
    return RequestRecord(index=i, model=model, input_tokens_target=prompt, output_tokens_target=len(tokens),
                         scheduled_s=sent if scheduled is None else scheduled, sent_s=sent, first_token_s=first,
                         end_s=end, token_times_s=list(tokens), outcome=outcome, prompt_tokens=prompt,
                         completion_tokens=completion if completion is not None else (len(tokens) or None),
                         route=route, served_model=served, escalated=escalated)


def test_per_request_ttft_tpot_itl_e2e():
    r = rec(0, sent=1.0, first=1.2, tokens=[1.2, 1.3, 1.5, 1.6], end=1.7)
    assert r.ttft_s == pytest.approx(0.2)
    assert r.e2e_s == pytest.approx(0.7)
    assert r.tpot_s == pytest.approx((0.7 - 0.2) / 3)  # (E2E - TTFT) / (out - 1)
    assert r.itl_s == pytest.approx([0.1, 0.2, 0.1])
    # Usage says 7 tokens arrived in 4 chunks: TPOT uses the server's count, ITL the chunk gaps.
    r7 = rec(1, sent=0.0, first=0.1, tokens=[0.1, 0.2, 0.3, 0.4], end=0.7, completion=7)
    assert r7.tpot_s == pytest.approx(0.1) and r7.output_tokens == 7
    assert rec(2, sent=0, first=0.1, tokens=[0.1], end=0.1).tpot_s is None


def test_percentiles_known_values():
    p = percentiles([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert p["count"] == 100 and p["max"] == 100.0 and p["mean"] == pytest.approx(50.5)
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01)
    assert p["p99.9"] == pytest.approx(99.901)
    assert percentiles([])["p50"] is None


def records_fixture():
    return [
        # fast route "a": ttft 100 ms, tpot 10 ms -> meets ttft<=200,tpot<=20
        rec(0, sent=0.0, first=0.1, tokens=[0.1, 0.11, 0.12], end=0.12, route="a", served="small"),
        # route "a": ttft 300 ms (miss), tpot 10 ms (hit)
        rec(1, sent=1.0, first=1.3, tokens=[1.3, 1.31, 1.32], end=1.32, route="a", served="small"),
        # route "b": ttft 50 ms, tpot 50 ms: meets b's SLO (ttft<=100, tpot<=60), escalated
        rec(2, sent=2.0, first=2.05, tokens=[2.05, 2.1, 2.15], end=2.15, route="b", served="large", escalated=True),
        # route "b": shed and failed count as misses for every dimension
        rec(3, sent=3.0, outcome="shed", route="b"),
        rec(4, sent=4.0, end=4.5, outcome="failed", route="b"),
        # scheduled inside the warm-up: sent but excluded
        rec(5, sent=-1.0, first=5.0, tokens=[5.0, 6.0], end=6.0, route="a", scheduled=-1.0),
        rec(6, sent=6.0, first=6.1, tokens=[6.1, 6.2], end=6.2, route="b", served="small", escalated=False),
    ]


def test_summary_counts_slos_goodput_split_and_cost():
    slos = {"a": Slo(ttft_ms=200, tpot_ms=20), "b": Slo(ttft_ms=100, tpot_ms=60)}
    s = summarise(records_fixture(), window=(0.0, 10.0), slos=slos, price_per_hour=36.0)
    assert s["requests"] == {"sent": 6, "completed": 4, "failed": 1, "shed": 1}
    a, b = s["per_route"]["a"], s["per_route"]["b"]
    assert a["slo"]["attainment"] == {"ttft": 0.5, "tpot": 1.0, "combined": 0.5}
    # b: request 2 meets both; 6 has ttft 100 ms (meets) and tpot 100 ms (misses); 3 and 4 miss.
    assert b["slo"]["attainment"] == {"ttft": 0.5, "tpot": 0.25, "combined": 0.25}
    assert (b["slo"]["ttft_ms"], b["slo"]["tpot_ms"]) == (100, 60)
    assert (b["requests"], b["completed"], b["failed"], b["shed"]) == (4, 2, 1, 1)
    assert s["slo_attainment"] == pytest.approx(2 / 6)
    assert s["goodput_rps"] == pytest.approx(0.2)  # 2 requests met every SLO in 10 s
    assert s["request_throughput_rps"] == pytest.approx(0.4)
    assert s["output_tokens"] == 11 and s["output_token_throughput_tps"] == pytest.approx(1.1)
    assert s["input_tokens"] == 40
    assert s["routing_split"] == {"large": 0.25, "small": 0.75}
    assert s["escalation_rate"] == pytest.approx(0.5)
    # $36/h for 10 s = $0.1 for 11 output tokens -> $0.1 / 0.011 per 1k output tokens.
    assert s["cost"]["usd"] == pytest.approx(0.1)
    assert s["cost"]["usd_per_1k_output_tokens"] == pytest.approx(0.1 / 0.011)
    assert s["overall"]["ttft_ms"]["count"] == 4
    assert s["overall"]["ttft_ms"]["max"] == pytest.approx(300.0)
    assert s["overall"]["itl_ms"]["count"] == 7  # pooled gaps: 2 + 2 + 2 + 1
    assert np.isclose(s["overall"]["tpot_ms"]["p50"], 30.0)  # tpots 10, 10, 50, 100


def test_wildcard_slo_and_no_slo():
    s = summarise(records_fixture(), window=(0.0, 10.0), slos={"*": Slo(ttft_ms=1000)})
    assert s["slo_attainment"] == pytest.approx(4 / 6)
    s2 = summarise(records_fixture(), window=(0.0, 10.0))
    assert "goodput_rps" not in s2 and "slo" not in s2["per_route"]["a"]


def test_one_token_answer_cannot_break_tpot():
    r = rec(0, sent=0, first=0.01, tokens=[0.01], end=0.01)
    assert meets(r, Slo(ttft_ms=50, tpot_ms=1)) == {"ttft": True, "tpot": True}


def test_parse_slo():
    assert parse_slo("auto:ttft=500,tpot=50") == ("auto", Slo(ttft_ms=500, tpot_ms=50))
    assert parse_slo("ttft=2000") == ("*", Slo(ttft_ms=2000))
    assert parse_slo("fast:e2e=900") == ("fast", Slo(e2e_ms=900))
    for bad in ("auto:ttft", "auto:speed=3", "auto:ttft=x", "auto:"):
        with pytest.raises(ValueError, match="--slo"):
            parse_slo(bad)


def test_highest_passing_rate_stops_at_the_knee():
    pts = [{"rate": 1, "slo_attainment": 1.0}, {"rate": 2, "slo_attainment": 0.995},
           {"rate": 4, "slo_attainment": 0.93}, {"rate": 8, "slo_attainment": 0.5},
           {"rate": 16, "slo_attainment": 0.95}]
    assert highest_passing_rate(pts, 0.99) == 2
    assert highest_passing_rate(pts, 0.90) == 4
    assert highest_passing_rate([{"rate": 1, "slo_attainment": 0.1}], 0.9) is None


PROM_TEXT = """# TYPE tandem:num_requests_waiting gauge
tandem:num_requests_waiting{model_name="tandem-small"} 2
tandem:num_requests_waiting{model_name="tandem-large"} 3
# TYPE tandem:kv_cache_usage_perc gauge
tandem:kv_cache_usage_perc{model_name="tandem-small"} 0.25
tandem:kv_cache_usage_perc{model_name="tandem-large"} 0.25
# TYPE tandem:prefix_cache_queries counter
tandem:prefix_cache_queries_total{model_name="tandem-small"} %(q)s
# TYPE tandem:prefix_cache_hits counter
tandem:prefix_cache_hits_total{model_name="tandem-small"} %(h)s
# TYPE tandem:router_decisions counter
tandem:router_decisions_total{route="auto",choice="tandem-small"} %(s)s
tandem:router_decisions_total{route="auto",choice="tandem-large"} 1
# TYPE tandem:time_to_first_token_seconds histogram
tandem:time_to_first_token_seconds_bucket{le="0.1",model_name="m",route="r"} 1
tandem:time_to_first_token_seconds_bucket{le="+Inf",model_name="m",route="r"} %(n)s
tandem:time_to_first_token_seconds_count{model_name="m",route="r"} %(n)s
tandem:time_to_first_token_seconds_sum{model_name="m",route="r"} %(t)s
"""


def test_prometheus_scrapes_become_gauges_counter_deltas_and_rates():
    from traces.server_metrics import MetricsScraper, parse_metrics

    first = parse_metrics(PROM_TEXT % {"q": 100, "h": 10, "s": 4, "n": 2, "t": 0.5})
    assert first["waiting"] == 5.0 and first["kv_usage"] == 0.25  # summed; one shared pool: max
    assert first["router_decisions"] == {"tandem-small": 4.0, "tandem-large": 1.0}
    last = parse_metrics(PROM_TEXT % {"q": 300, "h": 110, "s": 10, "n": 6, "t": 1.7})
    scraper = MetricsScraper("http://x", samples=[first | {"t_s": 0.0}, last | {"t_s": 1.0}])
    s = scraper.summary()
    assert s["available"] and s["prefix_cache_hit_rate"] == pytest.approx(0.5)  # 100 hits / 200 queries
    assert s["server_mean_ttft_s"] == pytest.approx(0.3)  # 1.2 s over 4 requests
    assert s["router_decisions"] == {"tandem-small": 6.0, "tandem-large": 0.0}
    assert s["spec_acceptance_rate"] is None and s["max_waiting"] == 5.0
    assert MetricsScraper("http://x", error="GET /metrics answered 404").summary() == {
        "available": False, "reason": "GET /metrics answered 404", "series": []}


def test_scrapes_read_any_metric_prefix():
    """A server run with `[telemetry] metric_prefix = "vllm"` reads the same (vLLM's own names)."""
    from traces.server_metrics import parse_metrics

    text = PROM_TEXT % {"q": 100, "h": 10, "s": 4, "n": 2, "t": 0.5}
    tandem = parse_metrics(text)
    assert tandem["prefix_queries"] == 100.0 and tandem["ttft_count"] == 2.0
    assert parse_metrics(text.replace("tandem:", "vllm:")) == tandem
