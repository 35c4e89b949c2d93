"""Router training on synthetic data with a known signal, targets and margins, and the train/eval CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from router_model.cli import main as router_main
from router_model.data import DataError, RouterExample, parse_example, read_examples
from router_model.evaluate import evaluate_scores
from router_model.features import FeatureConfig, HashBlock
from router_model.router import Router
from router_model.synthetic import synthetic_rows
from router_model.train import TrainOptions, train_router

SMALL_FEATURES = FeatureConfig(blocks=(HashBlock("tail", 0, (2, 5), 1 << 10),))


def _examples(n: int, seed: int) -> list[RouterExample]:
    return [parse_example(r, f"row {i}") for i, r in enumerate(synthetic_rows(n, seed=seed))]


def _opts(**kw) -> TrainOptions:
    return TrainOptions(feature_config=SMALL_FEATURES, c_grid=(1.0,), folds=3, **kw)


@pytest.fixture(scope="module")
def trained() -> Router:
    return train_router(_examples(400, seed=0), _opts(), log=lambda *_: None)


def test_router_learns_the_known_signal_on_unseen_prompts(trained):
    test = _examples(200, seed=1)
    scores = np.array([trained.score(ex.conversation) for ex in test])
    hard = np.array([ex.label for ex in test]) == 1
    assert scores[hard].min() > scores[~hard].max()  # perfectly separated
    q = np.array([ex.qualities() for ex in test])
    ev = evaluate_scores(scores, q[:, 0], q[:, 1])
    # the best a text-only router can do here: all hard prompts first (the rest of the gain is noise)
    ideal = evaluate_scores(hard + np.random.default_rng(0).random(hard.size) * 1e-3, q[:, 0], q[:, 1])
    assert ev.apgr == pytest.approx(ideal.apgr, abs=0.02) and ev.apgr > 0.75
    assert ev.cpt50 < 0.3
    assert trained.decide("prove that the integral of x 12 * 40 is finite", threshold=0.5)[0] == "large"
    assert trained.decide([{"role": "user", "content": "hello there, how are you"}], threshold=0.5)[0] == "small"


def test_probabilities_are_calibrated_to_the_positive_rate(trained):
    train = _examples(400, seed=0)
    scores = np.array([trained.score(ex.conversation) for ex in train])
    assert np.all((scores >= 0) & (scores <= 1))
    rate = np.mean([ex.large_needed(0.0) for ex in train])
    assert scores.mean() == pytest.approx(rate, abs=0.05)


def test_threshold_sends_the_target_fraction_large(trained):
    assert trained.target_large_fraction == 0.3
    test = _examples(300, seed=2)
    choices = [trained.decide(ex.conversation)[0] for ex in test]
    # 40% of synthetic prompts are hard and separable, so a 30% target lands within the hard ones
    assert 0.2 <= choices.count("large") / len(choices) <= 0.45
    assert trained.threshold_for_fraction(0.0) > 1.0
    assert trained.threshold_for_fraction(0.1) >= trained.threshold_for_fraction(0.5)


def test_binary_labels_alone_train_a_router():
    rows = synthetic_rows(300, seed=3)
    examples = [parse_example({k: v for k, v in r.items() if not k.endswith("_score")}, "r") for r in rows]
    router = train_router(examples, _opts(calibration="isotonic"), log=lambda *_: None)
    assert router.calibration.method == "isotonic"
    test = _examples(100, seed=8)
    scores = np.array([router.score(ex.conversation) for ex in test])
    hard = np.array([ex.label for ex in test]) == 1
    assert scores[hard].mean() > 0.9 and scores[~hard].mean() < 0.1


def test_margin_quantile_sets_the_positive_rate():
    router = train_router(_examples(300, seed=4), _opts(margin_quantile=0.8), log=lambda *_: None)
    assert router.metadata["positive_rate"] == pytest.approx(0.2, abs=0.01)


def test_a_margin_that_leaves_one_class_is_a_clear_error():
    with pytest.raises(DataError, match="nothing to learn"):
        train_router(_examples(100, seed=5), _opts(margin=10.0), log=lambda *_: None)


def test_bad_data_lines_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "hi", "label": 1}\n{"prompt": "x", "small_score": 1}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: give both"):
        read_examples(path)
    path.write_text('{"prompt": "hi", "label": 2}\n')
    with pytest.raises(DataError, match="must be 0 or 1"):
        read_examples(path)


def test_cli_trains_evaluates_and_saves_a_threshold(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic_rows(300, seed=6)))
    test = tmp_path / "test.jsonl"
    test.write_text("".join(json.dumps(r) + "\n" for r in synthetic_rows(200, seed=7)))
    out = tmp_path / "router"
    assert router_main(["train", "--data", str(data), "--out", str(out), "--C", "1", "--folds", "3",
                        "--hash-bits", "10"]) == 0
    metrics = tmp_path / "eval.json"
    assert router_main(["eval", "--data", str(test), "--router", str(out), "--target-large-fraction", "0.2",
                        "--json", str(metrics)]) == 0
    printed = capsys.readouterr().out
    assert "APGR" in printed and "CPT(50%)" in printed and "saved threshold" in printed
    ev = json.loads(metrics.read_text())
    assert ev["apgr"] > 0.7 and ev["cpt50"] < 0.35 and len(ev["pgr"]) == 10
    router = Router.load(out)  # the threshold edit keeps the artifact loadable
    assert router.target_large_fraction == 0.2
    rows = [parse_example(r, "r") for r in synthetic_rows(200, seed=7)]
    frac = np.mean([router.decide(ex.conversation)[0] == "large" for ex in rows])
    assert frac == pytest.approx(0.2, abs=0.01)


def test_cli_reports_errors_without_a_traceback(tmp_path, capsys):
    assert router_main(["eval", "--data", str(tmp_path / "none.jsonl"), "--router", str(tmp_path)]) == 2
    assert "missing" in capsys.readouterr().err
