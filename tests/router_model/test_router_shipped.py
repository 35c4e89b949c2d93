"""The router and escalation scorer shipped in models/router: load without pickle, honour their thresholds, and
meet the task-success targets on the held-out test modules' labels shipped beside them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from router_model.data import parse_example, read_rows
from router_model.evaluate import evaluate_scores
from router_model.router import JSON_NAME, Router

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "router"


@pytest.fixture(scope="module")
def shipped() -> Router:
    assert (SHIPPED / JSON_NAME).exists(), f"{SHIPPED} must hold the trained router (see models/router/README.md)"
    return Router.load(SHIPPED)


@pytest.fixture(scope="module")
def scorer() -> Router:
    return Router.load(SHIPPED / "cascade")


@pytest.fixture(scope="module")
def test_set():
    rows = read_rows(SHIPPED / "labels" / "test.jsonl.gz")
    return rows, [parse_example(r, f"row {i}") for i, r in enumerate(rows, 1)]


def _scores(r: Router, examples) -> np.ndarray:
    dense, hashed = r.featurizer.transform([e.conversation for e in examples], [e.extras for e in examples],
                                           [e.answer for e in examples])
    return r.score_many(dense, hashed)


def test_shipped_artifacts_load_and_score_prompts_and_conversations(shipped, scorer):
    assert shipped.kind == "router" and not shipped.required_extras and not shipped.needs_answer
    assert scorer.kind == "escalation" and scorer.needs_answer
    for x in ("def parse(self, text):\n    return json.loads(text)\n",
              [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
               {"role": "user", "content": "write a tokenizer"}]):
        choice, score = shipped.decide(x)
        assert 0.0 <= score <= 1.0 and choice in ("small", "large")
        stats = {k: -1.0 for k in scorer.required_extras}
        assert 0.0 <= scorer.score(x, stats, answer="return x") <= 1.0


def test_shipped_thresholds_send_the_target_fraction_of_held_out_prompts_large(shipped, scorer, test_set):
    _, examples = test_set
    for r in (shipped, scorer):
        scores = _scores(r, examples)
        assert np.mean(scores >= r.threshold) == pytest.approx(r.target_large_fraction, abs=0.01)
        assert np.mean(scores >= r.threshold_for_fraction(0.3)) == pytest.approx(0.3, abs=0.02)


def test_shipped_router_and_cascade_meet_the_targets_on_the_test_modules(shipped, scorer, test_set):
    rows, examples = test_set
    small = np.array([r["small_exact"] for r in rows])
    large = np.array([r["large_exact"] for r in rows])
    assert int(np.sum((large == 1) & (small == 0))) >= 200  # several hundred large-only wins to rank
    router = evaluate_scores(_scores(shipped, examples), small, large)
    cascade = evaluate_scores(_scores(scorer, examples), small, large)
    assert router.apgr >= 0.80 and router.cpt50 <= 0.20
    assert cascade.apgr >= router.apgr


def test_recorded_eval_is_the_one_in_the_readme(shipped):
    ev = json.loads((SHIPPED / "eval.json").read_text())
    readme = (SHIPPED / "README.md").read_text()
    assert f"{ev['apgr']:.3f}" in readme and len(ev["pgr"]) == 10
