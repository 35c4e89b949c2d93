"""The router artifact shipped in models/router: loads without pickle, honours its threshold, meets its targets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from router_model.router import JSON_NAME, Router

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "router"


@pytest.fixture(scope="module")
def shipped() -> Router:
    assert (SHIPPED / JSON_NAME).exists(), f"{SHIPPED} must hold the trained router (see models/router/README.md)"
    return Router.load(SHIPPED)


def test_shipped_router_loads_and_scores_prompts_and_conversations(shipped):
    extras = {name: -2.0 for name in shipped.required_extras}
    for x in ("def parse(self, text):\n    return json.loads(text)\n",
              [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
               {"role": "user", "content": "write a tokenizer"}]):
        choice, score = shipped.decide(x, extras=extras)
        assert 0.0 <= score <= 1.0 and choice in ("small", "large")


def test_shipped_threshold_sends_the_target_fraction_of_held_out_prompts_large(shipped):
    assert shipped.target_large_fraction == pytest.approx(0.3)
    rows = [json.loads(line) for line in (SHIPPED / "labels" / "test.jsonl").read_text().splitlines()]
    scores = np.array([shipped.score(r["prompt"], r.get("extras")) for r in rows])
    assert np.mean(scores >= shipped.threshold) == pytest.approx(0.3, abs=0.01)
    assert np.mean(scores >= shipped.threshold_for_fraction(0.3)) == pytest.approx(0.3, abs=0.01)


def test_recorded_eval_is_the_one_in_the_readme(shipped):
    ev = json.loads((SHIPPED / "eval.json").read_text())
    readme = (SHIPPED / "README.md").read_text()
    assert f"{ev['apgr']:.3f}" in readme and len(ev["pgr"]) == 10
