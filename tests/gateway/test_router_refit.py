"""The periodic refit of a router route (gateway/router_refit.py): it waits for enough new shadow labels, refits
from their stored features with the shipped rows as a prior, and swaps the route's router only through the
validation gate (a bar nothing clears keeps the old one; an open one installs, keeps the old as .previous and
swaps), each decision logged with both versions; the config refuses a refit without shadow labels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.config import ConfigError, RouteConfig, RouterConfig
from gateway.router_refit import PeriodicRefit
from gateway.router_strategy import RouterStrategy
from router_model.adapt import AdaptOptions, artifact_version
from router_model.cli import main as router_main
from router_model.data import read_rows
from router_model.router import Router
from router_model.scoring import agreement

ROOT = Path(__file__).resolve().parents[2]
PRIOR = ROOT / "models" / "router" / "labels"


class FakeRoute:
    """What the refit needs of a RouterStrategy: a name, the router it serves, swap()."""

    def __init__(self, router: Router):
        self.name, self.router, self.swapped = "auto", router, []

    def swap(self, router: Router, folder: str) -> None:
        self.router = router
        self.swapped.append(folder)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("refit")
    prior = root / "prior.jsonl"
    prior.write_text("".join(json.dumps(r) + "\n" for r in read_rows(PRIOR / "train.jsonl.gz")[:600]))
    current = root / "router"
    assert router_main(["train", "--data", str(prior), "--out", str(current), "--C", "1", "--folds", "3",
                        "--hash-bits", "8"]) == 0
    router = Router.load(current)
    labels = root / "shadow.jsonl"
    with labels.open("w") as f:  # shadow records as the gateway writes them: features and numbers, no text
        for r in read_rows(PRIOR / "test.jsonl.gz")[:300]:
            feats = router.features(r["prompt"])
            f.write(json.dumps({
                **agreement(r["small_answer"], r["large_answer"]), "small_answer_stats": r["small_answer_stats"],
                "small_chars": len(r["small_answer"]), "large_chars": len(r["large_answer"]),
                "features": {"dense": feats.dense.tolist(), "indices": feats.indices.tolist(),
                             "values": feats.values.tolist()}}) + "\n")
    return root, prior, current, labels


def _refit(setup, out: str, min_gain: float, min_labels: int = 100) -> tuple[PeriodicRefit, FakeRoute]:
    root, prior, current, labels = setup
    route = FakeRoute(Router.load(current))
    return PeriodicRefit(route, labels=str(labels), out=str(root / out), interval_s=3600, min_labels=min_labels,
                         current_dir=str(current), prior_data=str(prior),
                         options=AdaptOptions(min_gain=min_gain, prior_max=600)), route


def test_refit_waits_for_enough_new_labels(setup):
    refit, route = _refit(setup, "wait", 0.0, min_labels=1000)
    assert refit.run_once() is None and route.swapped == []


def test_refit_keeps_the_router_when_the_new_one_does_not_validate_better(setup):
    refit, route = _refit(setup, "kept", min_gain=1.0)  # APGR cannot rise by 1
    before = route.router
    rec = refit.run_once()
    assert rec["decision"] == "kept" and route.router is before and route.swapped == []
    assert not (Path(refit.out) / "router.npz").exists()
    assert refit.run_once() is None  # no new labels since


def test_refit_installs_and_swaps_when_better_and_logs_both_versions(setup):
    root, _, current, _ = setup
    refit, route = _refit(setup, "swapped", min_gain=-1.0)  # any refit clears this bar
    rec = refit.run_once()
    assert rec["decision"] == "swapped" and route.swapped == [str(root / "swapped")]
    assert route.router.metadata["adapted"]["from"]["version"] == artifact_version(current)
    assert artifact_version(root / "swapped") == rec["new"]["version"]
    log = [json.loads(line) for line in (root / "swapped" / "adapt_log.jsonl").read_text().splitlines()]
    assert log[-1]["current"]["version"] == artifact_version(current) and log[-1]["route"] == "auto"


def test_config_refuses_a_refit_without_shadow_labels(setup):
    _, _, current, _ = setup
    route = RouteConfig(engines=["s", "l"], strategy="router",
                        router=RouterConfig(artifact=str(current), refit_interval_s=60.0, refit_dir="x"))
    with pytest.raises(ConfigError, match="refit_interval_s needs shadow_fraction"):
        RouterStrategy("auto", route, Router.load(current))
