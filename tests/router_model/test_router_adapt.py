"""`tandem router adapt`: the gate installs a refit artifact only when it ranks the held-back self-labels better
than the current one (a hand-built better and worse pair), keeps the old one and logs both versions; the label
model reads disagreements; end to end through the CLI on tens of prompts with the real tiny pair."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from router_model.adapt import AdaptOptions, Traffic, artifact_version, decide, holdout_split, install
from router_model.cli import main as router_main
from router_model.data import read_rows
from router_model.features import FeatureConfig, HashBlock
from router_model.router import NUM_QUANTILES, Calibration, Router
from router_model.scoring import agreement
from router_model.self_labels import LabelModel

ROOT = Path(__file__).resolve().parents[2]
SMALL, LARGE = ROOT / "models" / "tandem-tiny-s", ROOT / "models" / "tandem-tiny-l"
FIXTURE = Path(__file__).parent / "fixtures" / "line_prompts.jsonl"
PRIOR = ROOT / "models" / "router" / "labels" / "train.jsonl.gz"
CFG = FeatureConfig(blocks=(HashBlock("tail", 60, (1, 3), 1 << 6),))


def _length_router(sign: float) -> Router:
    """A router whose score rises (sign +1) or falls (-1) with the prompt's log length, nothing else."""
    coef = np.zeros((1, CFG.num_dense + CFG.num_hashed))
    coef[0, CFG.stats.index("log_chars")] = sign
    return Router(feature_config=CFG, dense_mean=np.zeros(CFG.num_dense), dense_scale=np.ones(CFG.num_dense),
                  coef=coef, intercept=np.zeros(1), calibration=Calibration("sigmoid", a=np.array([-1.0]),
                                                                            b=np.array([0.0])),
                  score_quantiles=np.linspace(0, 1, NUM_QUANTILES), metadata={"trained_at": f"sign {sign:+g}"})


def _traffic() -> Traffic:
    """Long prompts need the large model (q = 0.9), short ones do not (q = 0.05)."""
    t = Traffic()
    for i in range(40):
        long = i % 2 == 0
        t.add("x = 1\n" * (30 if long else 2) + f"# {i}\n", 0.9 if long else 0.05, f"g{i}")
    return t


def test_a_better_refit_is_installed_the_old_one_kept_and_both_versions_logged(tmp_path):
    bad, good = _length_router(-1.0), _length_router(+1.0)
    cur_dir = bad.save(tmp_path / "current")
    out = good.save(tmp_path / "out")  # an artifact already there: it becomes out.previous
    (out / "cascade").mkdir()
    before = artifact_version(out)
    new = _length_router(+1.0)
    new.metadata["adapted"] = {}
    rec = decide(bad, cur_dir, new, _traffic(), out, AdaptOptions(), tmp_path / "log.jsonl", log=lambda *a: None)
    assert rec["decision"] == "swapped"
    assert rec["validation"]["new_apgr"] > 0.7 > 0.3 > rec["validation"]["current_apgr"]
    assert Router.load(out).metadata["adapted"]["from"]["version"] == artifact_version(cur_dir)
    assert artifact_version(tmp_path / "out.previous") == before
    assert (out / "cascade").is_dir()  # what else the folder held stays with the new artifact
    logged = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert logged[0]["current"]["version"] == artifact_version(cur_dir)
    assert logged[0]["new"]["version"] == artifact_version(out) and logged[0]["decision"] == "swapped"


def test_a_worse_refit_is_not_written(tmp_path):
    good = _length_router(+1.0)
    cur_dir = good.save(tmp_path / "current")
    new = _length_router(-1.0)
    new.metadata["adapted"] = {}
    out = tmp_path / "out"
    rec = decide(good, cur_dir, new, _traffic(), out, AdaptOptions(), tmp_path / "log.jsonl", log=lambda *a: None)
    assert rec["decision"] == "kept" and "new" not in rec
    assert not out.exists()
    same = _length_router(+1.0)
    same.metadata["adapted"] = {}
    assert decide(good, cur_dir, same, _traffic(), out, AdaptOptions(), None, log=lambda *a: None)["decision"] \
        == "kept"  # a tie is not better


def test_install_replaces_through_renames_and_leaves_no_temp_folder(tmp_path):
    out = _length_router(-1.0).save(tmp_path / "a")
    install(_length_router(+1.0), out)
    assert Router.load(out).metadata["trained_at"] == "sign +1"
    assert Router.load(tmp_path / "a.previous").metadata["trained_at"] == "sign -1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "a.previous"]


def test_holdout_keeps_groups_whole():
    groups = [f"m{i % 13}" for i in range(200)]
    fit, val = holdout_split(groups, 0.25)
    assert len(fit) + len(val) == 200 and len(val) > 0 and len(fit) > 0
    assert not {groups[i] for i in fit} & {groups[i] for i in val}


def test_label_model_ranks_large_only_wins_among_disagreements_and_zeroes_agreement():
    rows = read_rows(PRIOR)
    lm = LabelModel.fit(rows[:3000])
    test = rows[3000:6000]
    q = np.array([lm.label({"agreement": agreement(r["small_answer"], r["large_answer"]), **r}) for r in test])
    agree = np.array([agreement(r["small_answer"], r["large_answer"])["first_line_exact"] for r in test])
    win = np.array([r["large_score"] > r["small_score"] for r in test])
    assert np.all(q[agree == 1] == 0.0)
    from sklearn.metrics import roc_auc_score

    dis = agree == 0
    assert roc_auc_score(win[dis], q[dis]) > 0.7  # among disagreements, it finds the large model's wins
    assert LabelModel.from_dict(json.loads(json.dumps(lm.to_dict()))).label(
        {"agreement": agreement("a", "b"), "small_answer": "a", "large_answer": "b"}) == pytest.approx(
        lm.label({"agreement": agreement("a", "b"), "small_answer": "a", "large_answer": "b"}))


@pytest.mark.usefixtures("one_torch_thread")
def test_cli_adapts_on_tens_of_prompts_end_to_end(tmp_path, capsys):
    prior = tmp_path / "prior.jsonl"
    prior.write_text("".join(json.dumps(r) + "\n" for r in read_rows(PRIOR)[:600]))
    current = tmp_path / "router"
    small_train = ["--C", "1", "--folds", "3", "--hash-bits", "8"]
    assert router_main(["train", "--data", str(prior), "--out", str(current), *small_train]) == 0
    assert router_main(["train", "--kind", "escalation", "--data", str(prior), "--out", str(current / "cascade"),
                        *small_train]) == 0
    data = tmp_path / "traffic.jsonl"
    prompts = [r["prompt"] for r in read_rows(FIXTURE)[:40]]
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    cache, out = tmp_path / "pairs.jsonl", tmp_path / "adapted"
    common = ["adapt", "--data", str(data), "--router", str(current), "--small", str(SMALL), "--large", str(LARGE),
              "--stop", "\\n", "--max-tokens", "16", "--label-cache", str(cache), "--prior-data", str(prior)]
    capsys.readouterr()
    assert router_main([*common, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"answering {len(set(prompts))} distinct prompts on both engines (0 cached)" in printed
    pairs = read_rows(cache)
    assert len(pairs) == len(set(prompts)) and all({"small_answer", "large_answer", "small_answer_stats"} <= p.keys()
                                    for p in pairs)
    log = [json.loads(line) for line in (out / "adapt_log.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in log] == ["router", "escalation"]
    for rec, folder, dest in zip(log, (current, current / "cascade"), (out, out / "cascade")):
        assert rec["current"]["version"] == artifact_version(folder)
        assert rec["traffic"]["prompts"] == 40 and rec["validation"]["n"] > 0
        if rec["decision"] == "swapped":  # the written artifact loads, validates and names its parent
            new = Router.load(dest)
            assert new.kind == Router.load(folder).kind
            assert new.metadata["adapted"]["from"]["version"] == rec["current"]["version"]
            assert rec["new"]["version"] == artifact_version(dest)
        else:
            assert not (dest / "router.npz").exists()
    # a bar nothing can clear: nothing is written, and the cached pairs are not asked again
    out2 = tmp_path / "adapted2"
    assert router_main([*common, "--out", str(out2), "--min-gain", "1.0"]) == 0
    printed = capsys.readouterr().out
    assert "answering" not in printed
    log2 = [json.loads(line) for line in (out2 / "adapt_log.jsonl").read_text().splitlines()]
    assert [r["decision"] for r in log2] == ["kept", "kept"]
    assert not (out2 / "router.npz").exists() and not (out2 / "cascade").exists()


def test_disagreement_labels_are_one_minus_the_answers_edit_similarity(tmp_path):
    from router_model.adapt_cli import gather, parser
    from router_model.scoring import edit_similarity

    pairs = [("return x", "return x"), ("return x", "return y + 1"), ("pass", "raise ValueError(name)")]
    shadow = tmp_path / "shadow.jsonl"
    shadow.write_text("".join(json.dumps({"prompt": f"def f{i}():\n    ", **agreement(s, g)}) + "\n"
                              for i, (s, g) in enumerate(pairs)))
    args = parser().parse_args(["--router", "r", "--out", "o", "--shadow-labels", str(shadow),
                                "--label", "disagreement"])
    router_t, _, counts = gather(args, label_model=None, want_scorer=False)
    assert counts["shadow"] == 3
    assert router_t.q == pytest.approx([1.0 - edit_similarity(s, g) for s, g in pairs])
    assert router_t.q[0] == 0.0 and 0.0 < router_t.q[1] < router_t.q[2] <= 1.0
