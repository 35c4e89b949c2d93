"""`tandem router adapt`: refit the router and the cascade's escalation scorer on self-labelled traffic.

Labels come from the models themselves (router_model.self_labels): both engines answer the unlabelled prompts
(and/or the gateway's stored shadow records are read), each pair's agreement becomes P(large needed) through
the `LabelModel` fitted on the shipped artifact's reference-labelled data. The refit keeps the artifact's
feature config (so a shadow record's stored features are rows as they are) and its C; its rows are the shipped
training rows (hard labels, the prior: `prior_share` of the total weight) and the new traffic's rows, each
twice (large needed with weight q, not with 1 - q). A held-back slice of the traffic (by group) validates: the
new artifact is written only when its self-label APGR there beats the current one's by more than `min_gain`.
Every decision goes to a JSONL log with both artifacts' versions (the npz sha256).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from router_model.evaluate import evaluate_scores
from router_model.features import Conversation, Featurizer
from router_model.router import JSON_NAME, NPZ_NAME, NUM_QUANTILES, Router
from router_model.self_labels import LabelModel


@dataclass
class Traffic:
    """Self-labelled prompts: `q` = P(large needed) from the label model; `answer`/`stats` the small answer
    (the escalation scorer's inputs; None where unknown); rows from shadow records may carry only features."""

    conversations: list[Conversation | None] = field(default_factory=list)
    q: list[float] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    answers: list[str | None] = field(default_factory=list)
    stats: list[dict | None] = field(default_factory=list)
    features: list[dict | None] = field(default_factory=list)  # a shadow record's stored router features

    def add(self, conversation, q, group, answer=None, stats=None, features=None) -> None:
        self.conversations.append(conversation)
        self.q.append(float(q))
        self.groups.append(str(group))
        self.answers.append(answer)
        self.stats.append(stats)
        self.features.append(features)

    def __len__(self) -> int:
        return len(self.q)

    def subset(self, idx: Sequence[int]) -> Traffic:
        t = Traffic()
        for i in idx:
            t.add(self.conversations[i], self.q[i], self.groups[i], self.answers[i], self.stats[i],
                  self.features[i])
        return t


@dataclass
class AdaptOptions:
    holdout: float = 0.25  # share of the traffic's groups held back to validate on
    prior_share: float = 0.3  # the shipped rows' share of the total training weight
    prior_max: int = 3000  # shipped rows used at most (evenly spread), for the refit's cost
    min_gain: float = 0.0  # the new artifact must beat the current one by more than this (self-label APGR)
    folds: int = 3
    seed: int = 0
    C: float | None = None  # None: the artifact's own


def artifact_version(folder: str | Path) -> str:
    """An artifact's version: the first 12 hex digits of its npz's sha256 (what its JSON records)."""
    return hashlib.sha256((Path(folder) / NPZ_NAME).read_bytes()).hexdigest()[:12]


def holdout_split(groups: Sequence[str], share: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(fit, validation) indices: whole groups go to validation by a stable hash, about `share` of them."""
    val = np.array([int.from_bytes(hashlib.sha256(f"adapt:{seed}:{g}".encode()).digest()[:4], "big") % 1000
                    < share * 1000 for g in groups])
    if val.all() or not val.any():  # too few groups: fall back to every k-th row
        val = np.arange(len(groups)) % max(2, round(1 / max(share, 1e-3))) == 0
    return np.flatnonzero(~val), np.flatnonzero(val)


def _featurize(r: Router, t: Traffic) -> tuple[np.ndarray, sp.csr_matrix]:
    """The artifact's features of each traffic row: from the text, or a shadow record's stored vectors."""
    fz = Featurizer(r.feature_config)
    cfg = r.feature_config
    dense = np.zeros((len(t), cfg.num_dense))
    rows, cols, vals = [], [], []
    text_idx = [i for i in range(len(t)) if t.conversations[i] is not None]
    if text_idx:
        d, h = fz.transform([t.conversations[i] for i in text_idx], [t.stats[i] or {} for i in text_idx],
                            [t.answers[i] for i in text_idx] if cfg.needs_answer else None)
        dense[text_idx] = d
        h = h.tocoo()
        rows += [text_idx[k] for k in h.row]
        cols += h.col.tolist()
        vals += h.data.tolist()
    for i in range(len(t)):
        if t.conversations[i] is None:
            f = t.features[i]
            if f is None or len(f["dense"]) != cfg.num_dense or max(f["indices"], default=0) >= cfg.num_hashed:
                raise ValueError(f"traffic row {i}: stored features do not fit this artifact's feature config")
            dense[i] = f["dense"]
            rows += [i] * len(f["indices"])
            cols += list(f["indices"])
            vals += list(f["values"])
    hashed = sp.csr_matrix((vals, (rows, cols)), shape=(len(t), cfg.num_hashed))
    return dense, hashed


def self_label_apgr(scores: np.ndarray, q: np.ndarray) -> float:
    """APGR with the label model's expected gain as the quality (small 0, large q): how well scores rank the
    prompts the labels say need the large model, without a reference."""
    if float(np.sum(q)) <= 0.0:
        return float("nan")
    return evaluate_scores(scores, np.zeros_like(q), q).apgr


def refit(current: Router, prior_rows: list[dict], traffic: Traffic, opts: AdaptOptions, log=print) -> Router:
    """A new artifact of the same kind and features as `current`, fitted on prior + self-labelled traffic."""
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.model_selection import StratifiedGroupKFold

    from router_model.data import parse_example
    from router_model.train import design_matrix, estimator, fold_models

    t0 = time.perf_counter()
    if len(prior_rows) > opts.prior_max:
        keep = np.linspace(0, len(prior_rows) - 1, opts.prior_max).round().astype(int)
        prior_rows = [prior_rows[i] for i in keep]
    prior = Traffic()
    for i, row in enumerate(prior_rows):
        ex = parse_example(row, f"prior:{i}")
        if current.needs_answer and ex.answer is None:
            continue
        prior.add(ex.conversation, ex.large_needed(0.0), f"prior:{ex.group or i}", ex.answer, ex.extras)
    n_p, n_t = len(prior), len(traffic)
    dense_p, hashed_p = _featurize(current, prior)
    dense_t, hashed_t = _featurize(current, traffic)
    dense = np.vstack([dense_p, dense_t, dense_t])
    hashed = sp.vstack([hashed_p, hashed_t, hashed_t], format="csr")
    q = np.clip(np.asarray(traffic.q), 0.0, 1.0)
    y = np.concatenate([np.asarray(prior.q, int), np.ones(n_t, int), np.zeros(n_t, int)])
    w_prior = (opts.prior_share / (1.0 - opts.prior_share)) * n_t / max(n_p, 1) if n_p else 0.0
    w = np.concatenate([np.full(n_p, w_prior), q, 1.0 - q])
    keep = w > 0
    groups = np.array(prior.groups + traffic.groups + traffic.groups)
    mean = dense[keep].mean(0)
    scale = dense[keep].std(0)
    scale[scale < 1e-9] = 1.0
    x = design_matrix(dense[keep], hashed[keep], mean, scale)
    y, w, groups = y[keep], w[keep], groups[keep]
    w = w / w.mean()
    c = opts.C or float(current.metadata.get("C", 1.0))
    method = current.calibration.method
    folds = list(StratifiedGroupKFold(n_splits=opts.folds, shuffle=True, random_state=opts.seed).split(
        np.zeros(len(y)), y, groups=groups))
    cal = CalibratedClassifierCV(estimator(c, None), method=method, cv=folds, ensemble=True).fit(
        x, y, sample_weight=w)
    coef, intercept, calibration = fold_models(cal, method)
    new = Router(feature_config=current.feature_config, dense_mean=mean, dense_scale=scale, coef=coef,
                 intercept=intercept, calibration=calibration, kind=current.kind,
                 score_quantiles=np.zeros(NUM_QUANTILES))
    scores = new.score_many(dense_t, hashed_t)  # the traffic's own distribution: what a target maps onto
    new.score_quantiles = np.quantile(scores, np.linspace(0.0, 1.0, NUM_QUANTILES))
    new.target_large_fraction = current.target_large_fraction
    if current.target_large_fraction is not None:
        new.threshold = new.threshold_for_fraction(current.target_large_fraction)
    new.metadata = {"trained_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "C": c,
                    "adapted": {"prior_rows": n_p, "traffic_rows": n_t, "prior_share": opts.prior_share,
                                "folds": opts.folds, "mean_label": float(q.mean()) if n_t else None,
                                "seconds": round(time.perf_counter() - t0, 1)}}
    log(f"refit {current.kind}: {n_p} prior + {n_t} traffic rows (C={c:g}) in {time.perf_counter() - t0:.1f}s")
    return new


def validate(current: Router, new: Router, held: Traffic) -> dict[str, Any]:
    """Both artifacts on the held-back slice: self-label APGR and AUC of the expected gain."""
    q = np.asarray(held.q)
    out: dict[str, Any] = {"n": len(held), "mean_label": float(q.mean()) if len(held) else None}
    for name, r in (("current", current), ("new", new)):
        dense, hashed = _featurize(r, held)
        s = r.score_many(dense, hashed)
        out[f"{name}_apgr"] = self_label_apgr(s, q)
    return out


def install(new: Router, out: str | Path, previous: str | Path | None = None) -> Path:
    """Write `new` into `out` through a sibling temp folder and renames: a reader sees the old artifact or the
    new one, never half of one; an artifact already in `out` is kept as `out.previous`."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    new.save(tmp)
    if out.exists() and (out / NPZ_NAME).is_file():
        for p in out.iterdir():  # what else the folder holds (a cascade/ subfolder, a log) stays in it
            if p.name not in (JSON_NAME, NPZ_NAME):
                os.replace(p, tmp / p.name)
        old = Path(previous) if previous else out.with_name(out.name + ".previous")
        if old.exists():
            shutil.rmtree(old)
        os.replace(out, old)
    elif out.exists():
        # a folder that holds no artifact (e.g. adapt's own log, a cascade/ subfolder): move the files in
        for p in tmp.iterdir():
            os.replace(p, out / p.name)
        tmp.rmdir()
        return out
    os.replace(tmp, out)
    return out


def decide(current: Router, current_dir: str | Path, new: Router, held: Traffic, out: str | Path,
           opts: AdaptOptions, log_path: str | Path | None, log=print, label_model: LabelModel | None = None,
           extra: dict | None = None) -> dict[str, Any]:
    """Validate `new` against `current` on the held-back traffic; install it into `out` only when better there.
    Returns (and appends to `log_path`) the decision with both versions."""
    v = validate(current, new, held)
    better = bool(np.isfinite(v["new_apgr"]) and (not np.isfinite(v["current_apgr"])
                                                   or v["new_apgr"] > v["current_apgr"] + opts.min_gain))
    new.metadata["adapted"] |= {"from": {"folder": str(current_dir), "version": artifact_version(current_dir),
                                         "trained_at": current.metadata.get("trained_at")},
                                "validation": v, **({"label_model": label_model.to_dict()} if label_model else {})}
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "kind": current.kind,
              "current": {"folder": str(current_dir), "version": artifact_version(current_dir)},
              "validation": v, "min_gain": opts.min_gain, "decision": "swapped" if better else "kept",
              **(extra or {})}
    if better:
        dest = install(new, out)
        record["new"] = {"folder": str(dest), "version": artifact_version(dest)}
    log(f"{current.kind}: self-label APGR on {v['n']} held-back prompts: current {v['current_apgr']:.3f}, new "
        f"{v['new_apgr']:.3f} -> {record['decision']}" + (f" ({record['new']['folder']})" if better else ""))
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with Path(log_path).open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    return record
