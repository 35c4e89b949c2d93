"""The held target through a live server on the default tiny models and the shipped router: a stream of English
prose (the router was trained on code completion) for which the artifact's fixed threshold sends almost nothing
to the large model; the held threshold sends 30% +- 3 points of the recent window, and /v1/routes, the dashboard
data and /metrics say so, with the drift warning up."""

from __future__ import annotations

import random

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import load_config
from gateway.server import ServerThread
from router_model import Router

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WORDS = ("the morning train was late again so she walked along the river past the old mill where herons stood "
         "in the shallows and the bakery on the corner had already sold out of bread by eight o'clock because "
         "a wedding party ordered every loaf for the long lunch under the chestnut trees in the square").split()
WINDOW = 150
REQUESTS = 220


def _prose(n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(8, 40))).capitalize() + rng.choice([".", ",", " and"])
            for _ in range(n)]


def test_held_target_holds_on_prose_the_router_never_saw_and_is_shown_everywhere():
    cfg = load_config(env={}, overrides={"kv_pool.memory_bytes": "64MiB", "routes.auto.allow_downgrade": False,
                                         "routes.auto.router.window": WINDOW, "routes.auto.router.warmup": 40})
    prompts = _prose(REQUESTS)
    artifact = Router.load(cfg.routes["auto"].router.artifact)
    fixed = artifact.threshold_for_fraction(0.3)
    assert np.mean([artifact.score(p) >= fixed for p in prompts]) < 0.05  # the shift: fixed sends ~nothing
    with ServerThread(cfg) as srv, httpx.Client(base_url=srv.url, timeout=120) as client:
        served = []
        for p in prompts:
            r = client.post("/v1/completions", json={"model": "auto", "prompt": p, "max_tokens": 1})
            assert r.status_code == 200, r.text
            served.append(r.headers["x-tandem-model"] == "tandem-large")
        recent = float(np.mean(served[-WINDOW:]))
        assert abs(recent - 0.3) <= 0.03
        routes = {r["name"]: r for r in client.get("/v1/routes").json()["data"]}
        routing = routes["auto"]["routing"]
        assert routing["holding_target"] is True and routing["target_fraction"] == 0.3
        assert routing["window"]["realised_large_fraction"] == pytest.approx(recent)
        assert routing["window"]["scores"] == WINDOW and routing["decisions"] == REQUESTS
        assert routing["threshold"] < fixed / 2  # followed the prose's low scores down
        assert routing["drift"]["warning"] is True and routing["drift"]["ks"] > 0.3
        assert routes["fast"]["routing"] is None
        assert routes["cascade"]["routing"]["window"]["decisions"] == 0
        dash = {r["name"]: r for r in client.get("/dashboard/data").json()["routes"]}
        assert dash["auto"]["routing"]["realised_large_fraction"] == pytest.approx(recent)
        assert dash["auto"]["routing"]["drift"]["warning"] is True
        samples = {(s.name, s.labels.get("route"), s.labels.get("quantile")): s.value
                   for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples}
        assert samples[("tandem:router_realised_large_fraction", "auto", None)] == pytest.approx(recent)
        assert samples[("tandem:router_target_large_fraction", "auto", None)] == 0.3
        assert samples[("tandem:router_threshold", "auto", None)] == pytest.approx(routing["threshold"])
        assert samples[("tandem:router_score_drift_warning", "auto", None)] == 1.0
        assert samples[("tandem:router_score_quantile", "auto", "0.5")] == \
            pytest.approx(routing["window"]["score_quantiles"]["p50"])
