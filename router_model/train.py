"""Router training: features -> logistic regression, C chosen by grouped cross-validation, then scikit-learn's
CalibratedClassifierCV over the same grouped folds (ensemble: one calibrated model per fold, averaged).

The target is "the large model's answer is better by more than a margin" (or a given binary label); with
exact-match labels and margin 0 that is "the large model is right where the small one is wrong". The same
training builds the cascade's escalation scorer (`kind="escalation"`): its features also read the small
answer's text and logprob statistics. The artifact keeps only numpy arrays (router_model.router).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import scipy.sparse as sp

from router_model.data import DataError, RouterExample
from router_model.evaluate import evaluate_scores
from router_model.features import FeatureConfig, Featurizer, HashBlock
from router_model.router import CALIBRATIONS, NUM_QUANTILES, Calibration, Router
from router_model.scoring import ANSWER_STATS

# the escalation scorer's features: the prompt's tail, the small answer's text, the answer's logprob statistics
ESCALATION_FEATURES = FeatureConfig(
    blocks=(HashBlock("tail", 60, (1, 5), 1 << 16), HashBlock("tail", 300, (2, 5), 1 << 17),
            HashBlock("answer", 200, (1, 4), 1 << 16)),
    extras=ANSWER_STATS)


@dataclass
class TrainOptions:
    feature_config: FeatureConfig = field(default_factory=FeatureConfig)
    margin: float = 0.0  # large "meaningfully better": large_score - small_score > margin
    margin_quantile: float | None = None  # if set, the margin is this quantile of the score gains instead
    weighting: str = "none"  # "gain": weight each example by |gain - margin| (big wins/losses count more)
    calibration: str = "sigmoid"
    c_grid: tuple[float, ...] = (0.1, 0.3, 1.0, 3.0)
    class_weight: str | None = None  # "balanced": reweight the rarer class up
    folds: int = 5
    seed: int = 0
    target_large_fraction: float = 0.3
    kind: str = "router"  # or "escalation": the cascade's scorer (needs each example's small answer)

    def __post_init__(self) -> None:
        if self.calibration not in CALIBRATIONS:
            raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {self.calibration!r}")
        if self.weighting not in ("none", "gain"):
            raise ValueError(f"weighting must be 'none' or 'gain', got {self.weighting!r}")
        if self.margin_quantile is not None and not 0.0 < self.margin_quantile < 1.0:
            raise ValueError(f"margin quantile must be in (0, 1), got {self.margin_quantile}")
        if self.folds < 2:
            raise ValueError("folds must be at least 2")
        if self.kind not in ("router", "escalation"):
            raise ValueError(f"kind must be 'router' or 'escalation', got {self.kind!r}")


def featurize(examples: Sequence[RouterExample], featurizer: Featurizer) -> tuple[np.ndarray, sp.csr_matrix]:
    """(dense [n, num_dense], hashed CSR [n, num_hashed]) for a list of examples."""
    if featurizer.config.needs_answer and any(ex.answer is None for ex in examples):
        raise DataError("these features read the small model's answer: every line needs 'small_answer'")
    try:
        return featurizer.transform([ex.conversation for ex in examples], [ex.extras for ex in examples],
                                    [ex.answer for ex in examples])
    except ValueError as e:
        raise DataError(str(e)) from None


def design_matrix(dense: np.ndarray, hashed: sp.csr_matrix, mean: np.ndarray, scale: np.ndarray) -> sp.csr_matrix:
    return sp.hstack([sp.csr_matrix((dense - mean) / scale), hashed], format="csr")


def grouped_folds(examples: Sequence[RouterExample], k: int, seed: int,
                  y: np.ndarray | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Grouped folds when examples carry a group (a module never straddles folds), stratified by the target
    when given (rare positives spread over every fold); else shuffled (stratified) folds."""
    from sklearn.model_selection import KFold, StratifiedGroupKFold, StratifiedKFold

    n = len(examples)
    groups = [ex.group for ex in examples]
    target = np.zeros(n, int) if y is None else y
    if all(g is not None for g in groups) and len(set(groups)) >= k:
        folds = list(StratifiedGroupKFold(n_splits=k, shuffle=True, random_state=seed).split(
            np.zeros(n), target, groups=groups))
    elif y is not None and np.bincount(y).min() >= k:
        folds = list(StratifiedKFold(n_splits=k, shuffle=True, random_state=seed).split(np.zeros(n), y))
    else:
        folds = list(KFold(n_splits=k, shuffle=True, random_state=seed).split(np.zeros(n)))
    if y is not None:
        for train_idx, _ in folds:
            if np.unique(y[train_idx]).size < 2:
                raise DataError(f"{int(y.sum())} of {n} examples are positive (large needed): too few for {k} "
                                f"cross-validation folds; label more prompts, lower --folds or change the margin")
    return folds


def estimator(c: float, class_weight: str | None):
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(C=c, solver="liblinear", max_iter=2000, class_weight=class_weight)


def train_router(examples: Sequence[RouterExample], options: TrainOptions | None = None,
                 log=print) -> Router:
    """Fit a router on labelled examples; `metadata` records the choices and the cross-validated quality."""
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.model_selection import cross_val_predict

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
    x = design_matrix(dense, hashed, mean, scale)
    t_feat = time.perf_counter() - t0

    folds = grouped_folds(examples, opts.folds, opts.seed, y)
    qualities = np.array([ex.qualities() for ex in examples])
    best = None
    cv_table = []
    for c in opts.c_grid:
        oof = cross_val_predict(estimator(c, opts.class_weight), x, y, cv=folds, method="decision_function",
                                params={"sample_weight": w})
        apgr = evaluate_scores(oof, qualities[:, 0], qualities[:, 1]).apgr
        auc = _auc(oof, y)
        cv_table.append({"C": c, "cv_apgr": apgr, "cv_auc": auc})
        key = apgr if scored else auc
        if best is None or key > best[0]:
            best = (key, c)
        log(f"  C={c:<6g} cross-validated APGR {apgr:.4f}  AUC {auc:.4f}")
    c_best = best[1]
    cal = CalibratedClassifierCV(estimator(c_best, opts.class_weight), method=opts.calibration, cv=folds,
                                 ensemble=True).fit(x, y, sample_weight=w)
    coef, intercepts, calibration = fold_models(cal, opts.calibration)
    # out-of-fold calibrated scores (each fold's own model on the prompts it never saw): the score quantiles
    probs = calibration(np.asarray(x @ coef.T) + intercepts)
    oof_scores = np.zeros(len(examples))
    for k, (_, test_idx) in enumerate(folds):
        oof_scores[test_idx] = probs[test_idx, k]
    oof_eval = evaluate_scores(oof_scores, qualities[:, 0], qualities[:, 1])
    router = Router(
        feature_config=opts.feature_config, dense_mean=mean, dense_scale=scale, coef=coef,
        intercept=intercepts, calibration=calibration, kind=opts.kind,
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
            "cv_apgr_calibrated": oof_eval.apgr,
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


def fold_models(cal, method: str) -> tuple[np.ndarray, np.ndarray, Calibration]:
    """(coef [k, d], intercept [k], calibration) of a fitted CalibratedClassifierCV(ensemble=True): the arrays
    the artifact keeps."""
    coefs, intercepts, a, b, xs, ys = [], [], [], [], [], []
    for cc in cal.calibrated_classifiers_:
        coefs.append(cc.estimator.coef_.ravel())
        intercepts.append(float(cc.estimator.intercept_[0]))
        calibrator = cc.calibrators[0]
        if method == "sigmoid":
            a.append(float(calibrator.a_))
            b.append(float(calibrator.b_))
        else:
            xs.append(np.asarray(calibrator.X_thresholds_, float))
            ys.append(np.asarray(calibrator.y_thresholds_, float))
    return np.array(coefs), np.array(intercepts), Calibration(method, a=np.array(a), b=np.array(b), x=xs, y=ys)


def _auc(scores: np.ndarray, y: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(y, scores))
