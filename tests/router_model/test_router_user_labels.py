"""`tandem router label --data`: a user's own labelled JSONL in each of the three forms (reference answers
scored by exact match / edit similarity / a scoring command, judge scores, preference battles) labels, trains
and evaluates end to end through the CLI."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from router_model.cli import main as router_main
from router_model.data import read_rows
from router_model.router import Router
from router_model.scoring import edit_similarity
from router_model.synthetic import synthetic_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # engines run here

ROOT = Path(__file__).resolve().parents[2]
SMALL, LARGE = ROOT / "models" / "tandem-tiny-s", ROOT / "models" / "tandem-tiny-l"
TRAIN = ["--C", "1", "--folds", "3", "--hash-bits", "10"]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


FIXTURE = Path(__file__).parent / "fixtures" / "line_prompts.jsonl"


def _line_rows(n: int) -> list[dict]:
    """Code prompts cut at a line boundary with the next line as the reference: a fixed file of windows of the
    models' held-out modules (fixed, so the deterministic greedy labels do not move when this project's code
    changes; made by a shuffle of every 37th line of training.corpus's held-out split)."""
    return read_rows(FIXTURE)[:n]


def _train_and_eval(tmp_path: Path, labels: Path, capsys) -> dict:
    out = tmp_path / "router"
    assert router_main(["train", "--data", str(labels / "train.jsonl"), "--out", str(out), *TRAIN]) == 0
    metrics = tmp_path / "eval.json"
    assert router_main(["eval", "--data", str(labels / "test.jsonl"), "--router", str(out), "--bootstrap", "20",
                        "--json", str(metrics)]) == 0
    printed = capsys.readouterr().out
    assert "APGR" in printed and "oracle" in printed and "random" in printed
    Router.load(out)
    return json.loads(metrics.read_text())


def test_reference_answers_are_generated_scored_trained_and_evaluated(tmp_path, capsys):
    data = _write(tmp_path / "prompts.jsonl", _line_rows(96))
    labels = tmp_path / "labels"
    assert router_main(["label", "--data", str(data), "--small", str(SMALL), "--large", str(LARGE),
                        "--metric", "edit", "--stop", "\\n", "--max-tokens", "20", "--out-dir", str(labels),
                        "--test-fraction", "0.5"]) == 0
    rows = read_rows(labels / "train.jsonl") + read_rows(labels / "test.jsonl")
    assert len(rows) == 96
    for r in rows:
        assert "\n" not in r["small_answer"] and "\n" not in r["large_answer"]
        assert r["small_score"] == r["small_edit"] == pytest.approx(edit_similarity(r["small_answer"],
                                                                                    r["reference"]), abs=1e-4)
        assert "answer_mean_logprob" in r["small_answer_stats"]
    assert json.loads((labels / "summary.json").read_text())["forms"]["reference"] == 96
    ev = _train_and_eval(tmp_path, labels, capsys)
    # both metrics are kept; one is reported unless both models tie on it in this small test split
    assert set(ev["comparison"]) | set(ev["skipped_metrics"]) == {"exact", "edit"} and "edit" in ev["comparison"]
    assert {"router", "random", "oracle", "cascade (mean logprob)"} <= set(ev["comparison"]["edit"])
    # and the cascade's escalation scorer trains on the same file (it reads the small answers)
    assert router_main(["train", "--kind", "escalation", "--data", str(labels / "train.jsonl"),
                        "--out", str(tmp_path / "esc"), *TRAIN]) == 0
    assert Router.load(tmp_path / "esc").needs_answer


def test_a_user_scoring_command_scores_the_answers(tmp_path):
    scorer = tmp_path / "score.py"
    scorer.write_text("import json, sys\nfor line in sys.stdin:\n    d = json.loads(line)\n"
                      "    print(float(d['reference'].split()[:1] == d['answer'].split()[:1]))\n")
    data = _write(tmp_path / "prompts.jsonl", _line_rows(10))
    labels = tmp_path / "labels"
    assert router_main(["label", "--data", str(data), "--small", str(SMALL), "--large", str(LARGE),
                        "--metric", "command", "--score-command", f"{sys.executable} {scorer}", "--stop", "\\n",
                        "--max-tokens", "12", "--out-dir", str(labels)]) == 0
    rows = read_rows(labels / "train.jsonl") + read_rows(labels / "test.jsonl")
    for r in rows:
        first = float(r["reference"].split()[:1] == r["large_answer"].split()[:1])
        assert r["large_score"] == first


def test_judge_scores_train_and_evaluate(tmp_path, capsys):
    rows = [{k: r[k] for k in ("small_score", "large_score", "group")} | {"prompt": r.get("prompt") or
            r["messages"][-1]["content"]} for r in synthetic_rows(400, seed=0)]
    labels = tmp_path / "labels"
    assert router_main(["label", "--data", str(_write(tmp_path / "judged.jsonl", rows)),
                        "--out-dir", str(labels)]) == 0
    ev = _train_and_eval(tmp_path, labels, capsys)
    assert ev["apgr"] > 0.75  # the synthetic signal (proof / computation prompts) is learnt from judge scores


def test_preference_battles_train_and_evaluate(tmp_path, capsys):
    rng = random.Random(1)
    battles = []
    for r in synthetic_rows(500, seed=2):
        prompt = r.get("prompt") or r["messages"][-1]["content"]
        a, b = ("tiny-s", "tiny-l") if rng.random() < 0.5 else ("tiny-l", "tiny-s")
        if r["label"]:
            winner = "model_a" if a == "tiny-l" else "model_b"
        else:
            winner = rng.choice(["tie", "tie (bothbad)", "model_a", "model_b"])
        battles.append({"prompt": prompt, "model_a": a, "model_b": b, "winner": winner, "group": r["group"]})
    battles += [{"prompt": "x", "model_a": "gpt-x", "model_b": "tiny-l", "winner": "model_a"}] * 5
    labels = tmp_path / "labels"
    assert router_main(["label", "--data", str(_write(tmp_path / "battles.jsonl", battles)),
                        "--small-name", "tiny-s", "--large-name", "tiny-l", "--out-dir", str(labels)]) == 0
    summary = json.loads((labels / "summary.json").read_text())
    assert summary["forms"]["battle"] == 500 and summary["skipped_battles"] == 5
    ev = _train_and_eval(tmp_path, labels, capsys)
    assert ev["apgr"] > 0.6


def test_bad_lines_are_named(tmp_path, capsys):
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "a", "model_a": "s", "model_b": "l", "winner": "b"}])
    assert router_main(["label", "--data", str(bad), "--out-dir", str(tmp_path / "o")]) == 2
    assert "bad.jsonl:1: 'winner' must be one of" in capsys.readouterr().err
    refs = _write(tmp_path / "refs.jsonl", [{"prompt": "a", "reference": "b"}])
    assert router_main(["label", "--data", str(refs), "--out-dir", str(tmp_path / "o")]) == 2
    assert "give --small and --large" in capsys.readouterr().err
