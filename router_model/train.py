"""Router training: features -> logistic regression with C chosen by grouped cross-validation -> calibration.

The target is "the large model's answer is better by more than a margin" (or a given binary label). The
served model is the average of the cross-validation fold models; probabilities are calibrated on their
out-of-fold margins (Platt sigmoid by default, or isotonic), and the artifact keeps only numpy arrays.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import scipy.sparse as sp

from router_model.data import DataError, RouterExample
from router_model.evaluate import evaluate_scores
from router_model.features import FeatureConfig, Featurizer
from router_model.router import CALIBRATIONS, NUM_QUANTILES, Calibration, Router


@dataclass
class TrainOptions:
    feature_config: FeatureConfig = field(default_factory=FeatureConfig)
    margin: float = 0.0  # large "meaningfully better": large_score - small_score > margin
    margin_quantile: float | None = None  # if set, the margin is this quantile of the score gains instead
    weighting: str = "gain"  # "gain": weight each example by |gain - margin| (big wins/losses count more)
    calibration: str = "sigmoid"
    c_grid: tuple[float, ...] = (0.03, 0.1, 0.3, 1.0, 3.0)
    folds: int = 5
    seed: int = 0
    target_large_fraction: float = 0.3

    def __post_init__(self) -> None:
        if self.calibration not in CALIBRATIONS:
            raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {self.calibration!r}")
        if self.weighting not in ("none", "gain"):
            raise ValueError(f"weighting must be 'none' or 'gain', got {self.weighting!r}")
        if self.margin_quantile is not None and not 0.0 < self.margin_quantile < 1.0:
            raise ValueError(f"margin quantile must be in (0, 1), got {self.margin_quantile}")
        if self.folds < 2:
            raise ValueError("folds must be at least 2")


def featurize(examples: Sequence[RouterExample], featurizer: Featurizer) -> tuple[np.ndarray, sp.csr_matrix]:
    """(dense [n, num_dense], hashed CSR [n, num_hashed]) for a list of examples."""
    cfg = featurizer.config
    dense = np.zeros((len(examples), cfg.num_dense))
    indptr, indices, values = [0], [], []
    for i, ex in enumerate(examples):
        f = featurizer(ex.conversation, ex.extras)
        if f.extras_missing:
            raise DataError(f"example {i}: extra feature(s) {f.extras_missing} missing from its 'extras'")
        dense[i] = f.dense
        indices.append(f.indices)
        values.append(f.values)
        indptr.append(indptr[-1] + f.indices.size)
    hashed = sp.csr_matrix(
        (np.concatenate(values) if values else np.zeros(0), np.concatenate(indices) if indices else np.zeros(0, int),
         np.asarray(indptr)), shape=(len(examples), cfg.num_hashed))
    return dense, hashed


def _design(dense: np.ndarray, hashed: sp.csr_matrix, mean: np.ndarray, scale: np.ndarray) -> sp.csr_matrix:
    return sp.hstack([sp.csr_matrix((dense - mean) / scale), hashed], format="csr")


def _folds(examples: Sequence[RouterExample], k: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Grouped folds when examples carry a group (a module never straddles folds), else shuffled folds."""
    from sklearn.model_selection import GroupKFold, KFold

    n = len(examples)
    groups = [ex.group for ex in examples]
    if all(g is not None for g in groups) and len(set(groups)) >= k:
        return list(GroupKFold(n_splits=k).split(np.zeros(n), groups=groups))
    return list(KFold(n_splits=k, shuffle=True, random_state=seed).split(np.zeros(n)))


def _fit(x: sp.csr_matrix, y: np.ndarray, w: np.ndarray, c: float):
    from sklearn.linear_model import LogisticRegression

    clf = LogisticRegression(C=c, solver="liblinear", max_iter=2000)
    clf.fit(x, y, sample_weight=w)
    return clf


def _calibrate(z: np.ndarray, y: np.ndarray, method: str) -> Calibration:
    if method == "sigmoid":
        from sklearn.linear_model import LogisticRegression

        platt = LogisticRegression(C=1e6, solver="lbfgs").fit(z.reshape(-1, 1), y)
        return Calibration("sigmoid", a=-float(platt.coef_[0, 0]), b=-float(platt.intercept_[0]))
    from sklearn.isotonic import IsotonicRegression

    iso = IsotonicRegression(out_of_bounds="clip", y_min=0.0, y_max=1.0).fit(z, y)
    return Calibration("isotonic", x=np.asarray(iso.X_thresholds_, float), y=np.asarray(iso.y_thresholds_, float))


def train_router(examples: Sequence[RouterExample], options: TrainOptions | None = None,
                 log=print) -> Router:
    """Fit a router on labelled examples; `metadata` records the choices and the cross-validated quality."""
    opts = options or TrainOptions()
    t0 = time.perf_counter()
    if len(examples) < 4 * opts.folds:
        raise DataError(f"{len(examples)} examples are too few to train and calibrate ({4 * opts.folds} at least)")
    scored = all(ex.has_scores for ex in examples)
    gains = np.array([ex.large_score - ex.small_score for ex in examples]) if scored else None
    margin = opts.margin
    if opts.margin_quantile is not None:
        if gains is None:
            raise DataError("--margin-quantile needs small_score/large_score on every example")
        margin = float(np.quantile(gains, opts.margin_quantile))
    y = np.array([ex.large_needed(margin) for ex in examples])
    if y.min() == y.max():
        raise DataError(f"every example has target {y[0]} (margin {margin:g}): nothing to learn; change the margin")
    if opts.weighting == "gain" and gains is not None:
        w = np.abs(gains - margin)
        w = w / max(w.mean(), 1e-12) + 1e-3  # keep ties in play, barely
    else:
        w = np.ones(len(examples))

    featurizer = Featurizer(opts.feature_config)
    dense, hashed = featurize(examples, featurizer)
    mean = dense.mean(axis=0)
    scale = dense.std(axis=0)
    scale[scale < 1e-9] = 1.0
    x = _design(dense, hashed, mean, scale)
    t_feat = time.perf_counter() - t0

    folds = _folds(examples, opts.folds, opts.seed)
    qualities = np.array([ex.qualities() for ex in examples])
    best = None
    cv_table = []
    for c in opts.c_grid:
        oof = np.zeros(len(examples))
        coefs, intercepts = [], []
        for train_idx, test_idx in folds:
            clf = _fit(x[train_idx], y[train_idx], w[train_idx], c)
            oof[test_idx] = clf.decision_function(x[test_idx])
            coefs.append(clf.coef_.ravel())
            intercepts.append(float(clf.intercept_[0]))
        apgr = evaluate_scores(oof, qualities[:, 0], qualities[:, 1]).apgr
        auc = _auc(oof, y)
        cv_table.append({"C": c, "cv_apgr": apgr, "cv_auc": auc})
        key = apgr if scored else auc
        if best is None or key > best[0]:
            best = (key, c, oof, np.mean(coefs, axis=0), float(np.mean(intercepts)))
        log(f"  C={c:<6g} cross-validated APGR {apgr:.4f}  AUC {auc:.4f}")
    # The served model is the average of the fold models (a linear model again): its margins live on the same
    # scale as the out-of-fold margins the calibration and the score quantiles were fitted on; a refit on all
    # data would be sharper than them and shift the threshold.
    _, c_best, oof, coef, intercept = best
    calibration = _calibrate(oof, y, opts.calibration)
    oof_scores = calibration(oof)
    nd = opts.feature_config.num_dense
    router = Router(
        feature_config=opts.feature_config, dense_mean=mean, dense_scale=scale,
        coef_dense=coef[:nd].astype(np.float64), coef_hashed=coef[nd:].astype(np.float64),
        intercept=intercept, calibration=calibration,
        score_quantiles=np.quantile(oof_scores, np.linspace(0.0, 1.0, NUM_QUANTILES)),
        metadata={
            "trained_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "num_examples": len(examples),
            "positive_rate": float(y.mean()),
            "target": "label" if not scored else f"large_score - small_score > {margin:.6g}",
            "margin": margin,
            "options": {k: v for k, v in asdict(opts).items() if k != "feature_config"},
            "C": c_best,
            "cross_validation": cv_table,
            "num_folds": len(folds),
            "grouped_folds": all(ex.group is not None for ex in examples),
        },
    )
    router.target_large_fraction = opts.target_large_fraction
    router.threshold = router.threshold_for_fraction(opts.target_large_fraction)
    log(f"trained on {len(examples)} examples ({y.mean():.1%} large-needed, margin {margin:.4g}) with C={c_best:g}"
        f" in {time.perf_counter() - t0:.1f}s (features {t_feat:.1f}s); threshold {router.threshold:.4f} for "
        f"{opts.target_large_fraction:.0%} large")
    return router


def _auc(scores: np.ndarray, y: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(y, scores))
