"""The Prometheus metrics against real servers on the default tiny models: the catalog (gateway/metrics.py) is
exactly what a live registry exports and docs/metrics.md is rendered from it; every metric the Grafana dashboard
(deploy/grafana/tandem.json) queries is exported after traffic; with `metric_prefix = "vllm"` every metric vLLM's
official Grafana dashboard queries is exported, with the `model_name` label it filters on; the new per-request
families carry the values the answers report."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import ConfigError, load_config
from gateway.metrics import CATALOG, render_markdown, sample_names
from gateway.server import ServerThread

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana" / "tandem.json"

# Every metric vLLM's official dashboard (examples/online_serving/prometheus_grafana/grafana.json, the
# current version with 13 panels) names in its queries, as the samples Prometheus stores.
VLLM_DASHBOARD_METRICS = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count", "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_sum", "vllm:request_time_per_output_token_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total", "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum", "vllm:request_max_num_generation_tokens_sum",
]
MESSAGES = [{"role": "user", "content": "Tell me a short story about the sea."}]


def _config(prefix: str):
    # the default configuration (both tiny models, every route); a device price so the cost gauges exist
    env = {"TANDEM_COST__PRICE_PER_DEVICE_HOUR": "2.5", "TANDEM_TELEMETRY__METRIC_PREFIX": prefix}
    return load_config(None, env=env)


def _traffic(url: str) -> None:
    with httpx.Client(base_url=url, timeout=120) as client:
        for model in ("fast", "best", "auto", "cascade"):
            for stream in (False, True):
                r = client.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES,
                                                               "max_tokens": 6, "stream": stream})
                assert r.status_code == 200, r.text
        r = client.post("/v1/completions", json={"model": "fast", "prompt": "Once upon a time", "max_tokens": 4,
                                                 "n": 2})
        assert r.status_code == 200, r.text


def _samples(url: str) -> dict[str, list]:
    text = httpx.get(url + "/metrics").text
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _total(samples: dict[str, list], name: str, **labels: str) -> float:
    return sum(s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def tandem_server():
    with ServerThread(_config("tandem")) as srv:
        _traffic(srv.url)
        yield srv


@pytest.fixture(scope="module")
def vllm_server():
    with ServerThread(_config("vllm")) as srv:
        _traffic(srv.url)
        yield srv


def _grafana_metric_names(dashboard: dict) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return {name for expr in exprs for name in re.findall(r"\b(tandem:[a-zA-Z0-9_]+)", expr)}


def test_grafana_dashboard_queries_only_metrics_a_live_server_exports(tandem_server):
    dashboard = json.loads(GRAFANA.read_text())
    names = _grafana_metric_names(dashboard)
    assert len(dashboard["panels"]) >= 14 and len(names) >= 25
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"TTFT by route", "TPOT by engine", "SLO attainment", "Goodput", "Queue depth", "KV cache usage",
            "Prefix cache hit rate", "Routing split", "Cascade escalations", "Speculative acceptance",
            "Cost per 1k tokens", "Replicas"} <= titles
    exported = _samples(tandem_server.url)
    missing = sorted(names - set(exported))
    assert not missing, f"the dashboard queries metrics the server does not export: {missing}"
    # the traffic is in them
    assert _total(exported, "tandem:time_to_first_token_seconds_count", route="auto") == 2
    assert _total(exported, "tandem:slo_target_seconds", route="fast", kind="ttft") == 0.5
    assert _total(exported, "tandem:router_decisions_total", route="auto") == 2
    assert _total(exported, "tandem:cost_per_1k_tokens", route="best") >= 0
    assert _total(exported, "tandem:autoscale_desired_replicas") >= 1


def test_grafana_queries_are_valid_promql():
    import promql_parser

    dashboard = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 30
    for expr in exprs:  # Grafana's variables as Prometheus would receive them
        expr = expr.replace("$__rate_interval", "1m").replace("$route", ".*").replace("$model_name", ".*")
        promql_parser.parse(expr)  # raises on a syntax or type error
    with pytest.raises(Exception, match="matrix"):
        promql_parser.parse("rate(tandem:prompt_tokens_total)")


def test_grafana_json_is_what_its_generator_writes():
    sys.path.insert(0, str(GRAFANA.parent))
    try:
        import build_dashboard
    finally:
        sys.path.remove(str(GRAFANA.parent))
    assert GRAFANA.read_text() == build_dashboard.render(), "run deploy/grafana/build_dashboard.py"


def test_vllm_prefix_exports_everything_the_official_vllm_dashboard_queries(vllm_server):
    exported = _samples(vllm_server.url)
    missing = [name for name in VLLM_DASHBOARD_METRICS if name not in exported]
    assert not missing, f"vLLM's dashboard would miss: {missing}"
    assert not [name for name in exported if name.startswith("tandem:")]
    for name in VLLM_DASHBOARD_METRICS:  # its panels filter on model_name="$model_name"
        assert all("model_name" in s.labels for s in exported[name]), name
    for name in ("vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
                 "vllm:request_max_num_generation_tokens_sum", "vllm:request_prompt_tokens_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:generation_tokens_total"):
        assert _total(exported, name, model_name="tandem-small") > 0, name
    # vLLM's label set on vLLM's families (one line per model on its panels); by route under their own names
    assert not [name for name in VLLM_DASHBOARD_METRICS if any("route" in s.labels for s in exported[name])]
    counts = [s.labels["model_name"] for s in exported["vllm:e2e_request_latency_seconds_count"]]
    assert sorted(counts) == sorted(set(counts))
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:request_success_total",
                 "vllm:request_prompt_tokens_count"):
        by_route = name.replace("vllm:", "vllm:route_", 1)
        assert _total(exported, name, model_name="tandem-small") == _total(exported, by_route,
                                                                           model_name="tandem-small") > 0, name
    assert _total(exported, "vllm:route_e2e_request_latency_seconds_count", route="best") == 2
    # vLLM's token buckets: the 1-2-5 series up to the engine's max_model_len
    max_len = vllm_server.app.state.gateway.engines["tandem-small"].max_model_len
    bounds = sorted({float(s.labels["le"]) for s in exported["vllm:request_prompt_tokens_bucket"]
                     if s.labels["model_name"] == "tandem-small"})
    assert bounds[:6] == [1, 2, 5, 10, 20, 50] and bounds[-1] == float("inf") and bounds[-2] <= max_len < bounds[-2] * 2.5


def test_catalog_is_the_live_registry_and_docs_are_rendered_from_it(tandem_server):
    text = httpx.get(tandem_server.url + "/metrics").text
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    catalog = {f"tandem:{m.name}": m.kind for m in CATALOG}
    assert families == catalog
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert exported <= sample_names("tandem")
    for spec in CATALOG:  # labels as documented
        for f in text_string_to_metric_families(text):
            if f.name == f"tandem:{spec.name}":
                for s in f.samples:
                    assert set(s.labels) - {"le"} == set(spec.labels), (spec.name, s.labels)
    assert (ROOT / "docs" / "metrics.md").read_text() == render_markdown(), \
        "regenerate: python -m gateway.metrics > docs/metrics.md"


def test_per_request_families_match_the_answer(tandem_server):
    url = tandem_server.url
    before = _samples(url)
    r = httpx.post(url + "/v1/completions", json={"model": "best", "prompt": "The quick brown fox", "max_tokens": 5,
                                                  "n": 3, "temperature": 1.0, "seed": 7}, timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    after = _samples(url)

    def delta(name: str) -> float:
        labels = {"model_name": "tandem-large", "route": "best"}
        return _total(after, name, **labels) - _total(before, name, **labels)

    assert delta("tandem:request_prompt_tokens_sum") == usage["prompt_tokens"]
    assert delta("tandem:request_generation_tokens_sum") == usage["completion_tokens"]
    assert delta("tandem:request_params_n_sum") == 3 and delta("tandem:request_params_n_count") == 1
    most = delta("tandem:request_max_num_generation_tokens_sum")
    assert usage["completion_tokens"] / 3 <= most <= min(5, usage["completion_tokens"])
    for phase in ("prefill", "decode", "inference", "queue"):
        assert delta(f"tandem:request_{phase}_time_seconds_count") == 1, phase
    prefill, decode = delta("tandem:request_prefill_time_seconds_sum"), delta("tandem:request_decode_time_seconds_sum")
    inference = delta("tandem:request_inference_time_seconds_sum")
    assert prefill > 0 and decode > 0 and inference == pytest.approx(prefill + decode, rel=1e-6, abs=1e-9)
    assert inference <= delta("tandem:e2e_request_latency_seconds_sum")


def test_metric_prefix_must_be_a_prometheus_name():
    for bad in ("1tandem", "tan-dem", "a:b"):
        with pytest.raises(ConfigError, match="metric_prefix"):
            load_config(None, env={"TANDEM_TELEMETRY__METRIC_PREFIX": bad})
    assert load_config(None, env={"TANDEM_TELEMETRY__METRIC_PREFIX": "vllm"}).telemetry.metric_prefix == "vllm"
    assert load_config(None, env={}).telemetry.metric_prefix == "tandem"
