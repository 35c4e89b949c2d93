"""Shadow labels: the agreement label, the sampler's fraction and budget, the bounded label file; and through a
live server on the default tiny models, pairs run on both engines whose labels equal the agreement of the two
engines' own greedy answers (asked for separately on the fixed routes), stored with features and no prompt
text, their cost in /metrics and /v1/routes."""

from __future__ import annotations

import json
import math
import random
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import ConfigError, load_config
from gateway.server import ServerThread
from gateway.shadow import LabelStore, ShadowSampler
from router_model.scoring import agreement

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_agreement_labels_first_line_whole_answer_and_edit_similarity():
    assert agreement("x = 1\nprint(x)", "x = 1\nreturn x") == {
        "first_line_exact": 1.0, "exact": 0.0, "edit_similarity": pytest.approx(0.6, abs=0.1)}
    assert agreement("a  b", "a b")["exact"] == 1.0  # whitespace-normalised, as the labeller scores lines
    assert agreement("", "") == {"first_line_exact": 1.0, "exact": 1.0, "edit_similarity": 1.0}


def test_sampler_admits_its_fraction_within_its_budget():
    s = ShadowSampler(0.25, max_inflight=1000, rng=random.Random(1))
    admitted = sum(s.admit() for _ in range(4000))
    assert abs(admitted / 4000 - 0.25) < 0.03 and s.inflight == admitted
    tight = ShadowSampler(1.0, max_inflight=2)
    assert [tight.admit() for _ in range(4)] == [True, True, False, False]
    assert tight.counts["skipped_budget"] == 2
    tight.done("labelled")
    assert tight.admit() and tight.counts["labelled"] == 1
    assert not any(ShadowSampler(0.0, 5).admit() for _ in range(100))


def test_label_file_is_bounded_and_rotates_once(tmp_path):
    path = tmp_path / "labels" / "shadow.jsonl"
    store = LabelStore(str(path), max_records=3)
    for i in range(8):
        store.append({"i": i})
    rotated = path.with_name("shadow.jsonl.1")
    assert [json.loads(line)["i"] for line in rotated.read_text().splitlines()] == [3, 4, 5]
    assert [json.loads(line)["i"] for line in path.read_text().splitlines()] == [6, 7]
    again = LabelStore(str(path), max_records=3)  # a restart counts the lines already there
    again.append({"i": 8})
    again.append({"i": 9})
    assert [json.loads(line)["i"] for line in path.read_text().splitlines()] == [9]


def test_shadow_fraction_is_bounded_in_config():
    with pytest.raises(ConfigError, match="shadow_fraction"):
        load_config(env={}, overrides={"routes.auto.router.shadow_fraction": 0.9})


PROMPTS = [f"def f{i}(x):\n    return x + {i}\n\ndef g{i}(y):\n    " for i in range(10)]


def _wait_idle(client: httpx.Client) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        routes = {r["name"]: r for r in client.get("/v1/routes").json()["data"]}
        shadow = routes["auto"]["routing"]["shadow"]
        if shadow["inflight"] == 0:
            return shadow
        time.sleep(0.05)
    raise AssertionError("shadow pairs did not finish")


def test_shadow_pairs_label_by_the_engines_own_greedy_agreement(tmp_path):
    labels = tmp_path / "shadow.jsonl"
    cfg = load_config(env={}, overrides={
        "kv_pool.memory_bytes": "64MiB", "routes.auto.router.shadow_fraction": 0.5,
        "routes.auto.router.shadow_max_inflight": 1, "routes.auto.router.shadow_max_tokens": 6,
        "routes.auto.router.shadow_labels": str(labels), "routes.auto.router.shadow_max_records": 100})
    with ServerThread(cfg) as srv, httpx.Client(base_url=srv.url, timeout=120) as client:
        for p in PROMPTS:
            r = client.post("/v1/completions", json={"model": "auto", "prompt": p, "max_tokens": 4, "temperature": 1.0})
            assert r.status_code == 200, r.text
            _wait_idle(client)  # one at a time: none skipped for the budget
        shadow = _wait_idle(client)
        records = [json.loads(line) for line in labels.read_text().splitlines()]
        assert shadow["labelled"] == len(records) >= 2 and shadow["failed"] == 0 and shadow["skipped_budget"] == 0
        text = labels.read_text()
        assert not any(p.strip() in text for p in PROMPTS) and "prompt" not in records[0]
        for rec in records:  # the label is the agreement of the engines' own greedy answers, asked separately
            dense, idx = rec["features"]["dense"], rec["features"]["indices"]
            assert len(dense) > 0 and len(idx) == len(rec["features"]["values"]) > 0
            assert rec["route"] == "auto" and rec["max_tokens"] == 4 and rec["choice"] in ("small", "large")
        # the records do not name their prompt: find it by its router score (each prompt's is its own)
        strategy = srv.app.state.gateway.routes.strategies["auto"]
        by_score = {round(strategy.router.score(p), 9): p for p in PROMPTS}
        assert len(by_score) == len(PROMPTS)
        for rec in records:
            prompt = by_score[round(rec["router_score"], 9)]
            small = client.post("/v1/completions", json={"model": "fast", "prompt": prompt, "max_tokens": 4,
                                                         "temperature": 0}).json()["choices"][0]["text"]
            large = client.post("/v1/completions", json={"model": "best", "prompt": prompt, "max_tokens": 4,
                                                         "temperature": 0}).json()["choices"][0]["text"]
            assert {k: rec[k] for k in ("first_line_exact", "exact", "edit_similarity")} == \
                pytest.approx(agreement(small, large))
            # numbers for `tandem router adapt`'s label model, not the text: lengths and the small answer's
            # logprob statistics (a 1-4 token answer: log1p(tokens) and logprobs <= 0)
            assert rec["small_chars"] == len(small) and rec["large_chars"] == len(large)
            st = rec["small_answer_stats"]
            assert 0 < st["answer_log_tokens"] <= math.log1p(4) + 1e-4
            assert st["answer_min_logprob"] <= st["answer_mean_logprob"] <= 0
        samples = {(s.name, s.labels.get("route"), s.labels.get("outcome"), s.labels.get("model_name")): s.value
                   for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples}
        assert samples[("tandem:router_shadow_runs_total", "auto", "labelled", None)] == len(records)
        for engine in ("tandem-small", "tandem-large"):
            assert samples[("tandem:router_shadow_tokens_total", "auto", None, engine)] == shadow["tokens"][engine] > 0
        agreed = sum(r["first_line_exact"] for r in records) / len(records)
        assert samples[("tandem:router_shadow_agreement", "auto", None, None)] == pytest.approx(agreed)
