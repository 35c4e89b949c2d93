"""The trained router at serve time: the k calibrated fold models of scikit-learn's CalibratedClassifierCV
(each a logistic regression over `Featurizer` features plus its Platt or isotonic calibration), averaged.

Owns the artifact format (router.json + router.npz, never pickle; the JSON records a version and the npz's
sha256, both checked on load) and numpy inference (the n-gram hashing in C where it builds, router_model.native):
`score` -> P(large needed), `decide` -> route choice.
The same artifact kind serves the cascade's escalation scorer (`kind = "escalation"`), which also reads the
small model's answer and its logprob statistics.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from router_model.features import Conversation, FeatureConfig, Featurizer, PromptFeatures

ARTIFACT_FORMAT = "tandem-router"
# 2: HashingVectorizer blocks + an ensemble of calibrated fold models (CalibratedClassifierCV); 1 was one model
ARTIFACT_VERSION = 2
JSON_NAME = "router.json"
NPZ_NAME = "router.npz"
CALIBRATIONS = ("sigmoid", "isotonic")
KINDS = ("router", "escalation")  # escalation: the cascade's scorer, which also reads the small answer
# 0..100th percentiles of the calibrated score on held-out data: maps a target large fraction to a threshold.
NUM_QUANTILES = 101


class RouterArtifactError(ValueError):
    """A router folder that cannot be loaded; the message names the file and what is wrong with it."""


class MissingExtraFeature(ValueError):
    """The router was trained with an extra feature (e.g. the small model's prompt log-prob) not supplied."""


@dataclass
class Calibration:
    """Raw linear margins z [k] of the k fold models -> probabilities [k]. sigmoid: 1/(1+exp(a*z+b)) (Platt,
    as sklearn's _SigmoidCalibration); isotonic: clipped interpolation in each fold's table."""

    method: str
    a: np.ndarray = field(default_factory=lambda: np.zeros(0))
    b: np.ndarray = field(default_factory=lambda: np.zeros(0))
    x: list[np.ndarray] = field(default_factory=list)
    y: list[np.ndarray] = field(default_factory=list)

    def __call__(self, z: np.ndarray) -> np.ndarray:
        z = np.asarray(z, dtype=np.float64)
        if self.method == "sigmoid":  # in place: a request's k margins cost a few ufunc calls, not their setup
            t = self.a * z
            t += self.b
            np.maximum(t, -500.0, out=t)  # np.clip's values, without its wrapper
            np.minimum(t, 500.0, out=t)
            np.exp(t, out=t)
            t += 1.0
            return np.divide(1.0, t, out=t)
        return np.array([np.interp(zk, xk, yk) for zk, xk, yk in zip(z.T if z.ndim > 1 else z, self.x, self.y)]
                        ).T

    @property
    def folds(self) -> int:
        return int(self.a.size) if self.method == "sigmoid" else len(self.x)


@dataclass
class Router:
    feature_config: FeatureConfig
    dense_mean: np.ndarray  # standardisation of the dense part (stats, extras) learnt on the training set
    dense_scale: np.ndarray
    coef: np.ndarray  # [k, num_dense + num_hashed]: one linear model per cross-validation fold
    intercept: np.ndarray  # [k]
    calibration: Calibration
    score_quantiles: np.ndarray  # [NUM_QUANTILES] calibrated scores on held-out data, ascending (in the JSON)
    threshold: float = 0.5
    target_large_fraction: float | None = None
    kind: str = "router"
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # the weights are stored as float32; hold exactly those values so a saved copy scores the same
        self.coef = np.atleast_2d(np.asarray(self.coef, dtype=np.float32)).astype(np.float64)
        self.intercept = np.atleast_1d(np.asarray(self.intercept, dtype=np.float64))
        self.featurizer = Featurizer(self.feature_config)
        self.featurizer.warm()  # build the analyzers now, not on the first request
        nd = self.feature_config.num_dense
        self._coef_dense = self.coef[:, :nd]
        self._coef_hashed = self.coef[:, nd:]
        # [num_hashed, k]: one row gather a request, in float32 (the stored values, exactly) for half the memory
        self._coef_hashed_rows = np.ascontiguousarray(self._coef_hashed.T, dtype=np.float32)

    # ---- inference -------------------------------------------------------------------------------------
    @property
    def required_extras(self) -> tuple[str, ...]:
        """Extra feature names the caller must pass to `score` (empty for a text-only router)."""
        return self.feature_config.extras

    @property
    def needs_answer(self) -> bool:
        """True for an escalation scorer: it reads the small model's answer text too."""
        return self.feature_config.needs_answer

    def features(self, x: Conversation, extras: Mapping[str, float] | None = None,
                 answer: str | None = None) -> PromptFeatures:
        feats = self.featurizer(x, extras, answer)
        if feats.extras_missing:
            raise MissingExtraFeature(
                f"this router needs extra feature(s) {', '.join(feats.extras_missing)} "
                f"(pass extras={{name: value}}; e.g. answer statistics from router_model.scoring.answer_stats)")
        return feats

    def margins_of(self, feats: PromptFeatures) -> np.ndarray:
        """The raw linear scores of the k fold models (log-odds before calibration)."""
        dense = (feats.dense - self.dense_mean) / self.dense_scale
        rows = self._coef_hashed_rows.take(feats.indices, axis=0).astype(np.float64)  # take: the fast gather
        return self.intercept + self._coef_dense @ dense + feats.values @ rows

    def score(self, x: Conversation, extras: Mapping[str, float] | None = None, answer: str | None = None) -> float:
        """P(the large model is needed): the mean of the k calibrated fold models (CalibratedClassifierCV's
        ensemble) for a prompt string or a list of OpenAI-style messages (and the small answer, if it reads one)."""
        p = self.calibration(self.margins_of(self.features(x, extras, answer)))
        return float(p.sum() / p.size)  # np.mean's value, without its wrapper

    def score_many(self, dense: np.ndarray, hashed) -> np.ndarray:
        """Scores of a featurised batch (`Featurizer.transform`'s output), equal to `score` row by row."""
        z = self.intercept + ((dense - self.dense_mean) / self.dense_scale) @ self._coef_dense.T \
            + np.asarray(hashed @ self._coef_hashed.T)
        return np.mean(self.calibration(z), axis=1)

    def decide(self, x: Conversation, threshold: float | None = None, extras: Mapping[str, float] | None = None,
               answer: str | None = None) -> tuple[str, float]:
        """("large" | "small", score): large when the score reaches the threshold (the artifact's by default)."""
        s = self.score(x, extras, answer)
        return ("large" if s >= (self.threshold if threshold is None else threshold) else "small"), s

    def threshold_for_fraction(self, fraction: float) -> float:
        """The score threshold that sends about `fraction` of (held-out-like) traffic to the large model."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"target large fraction must be in [0, 1], got {fraction}")
        if fraction <= 0.0:
            return math.nextafter(1.0, 2.0)  # above every probability: never large
        return float(np.quantile(self.score_quantiles, 1.0 - fraction))

    # ---- artifact ---------------------------------------------------------------------------------------
    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        cal = self.calibration
        arrays = {
            "dense_mean": self.dense_mean.astype(np.float64),
            "dense_scale": self.dense_scale.astype(np.float64),
            "coef": self.coef.astype(np.float32),
            "intercept": self.intercept.astype(np.float64),
            "calibration_a": np.asarray(cal.a, dtype=np.float64),
            "calibration_b": np.asarray(cal.b, dtype=np.float64),
            # isotonic tables of the k folds, concatenated; calibration_sizes says where each ends
            "calibration_x": np.concatenate(cal.x) if cal.x else np.zeros(0),
            "calibration_y": np.concatenate(cal.y) if cal.y else np.zeros(0),
            "calibration_sizes": np.array([len(v) for v in cal.x], dtype=np.int64),
        }
        buf = io.BytesIO()
        np.savez_compressed(buf, **arrays)
        blob = buf.getvalue()
        (folder / NPZ_NAME).write_bytes(blob)
        doc = {
            "format": ARTIFACT_FORMAT,
            "version": ARTIFACT_VERSION,
            "kind": self.kind,
            "npz_sha256": hashlib.sha256(blob).hexdigest(),
            "feature_config": self.feature_config.to_dict(),
            "calibration": {"method": cal.method, "folds": cal.folds},
            "threshold": self.threshold,
            "target_large_fraction": self.target_large_fraction,
            "score_quantiles": [float(v) for v in self.score_quantiles],
            "metadata": self.metadata,
        }
        (folder / JSON_NAME).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        return folder

    def save_threshold(self, folder: str | Path) -> None:
        """Rewrite only the JSON's threshold fields and score quantiles (the npz and its checksum stay)."""
        path = Path(folder) / JSON_NAME
        doc = json.loads(path.read_text())
        doc["threshold"] = self.threshold
        doc["target_large_fraction"] = self.target_large_fraction
        doc["score_quantiles"] = [float(v) for v in self.score_quantiles]
        path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> Router:
        folder = Path(folder)
        jpath, npath = folder / JSON_NAME, folder / NPZ_NAME
        for p in (jpath, npath):
            if not p.is_file():
                raise RouterArtifactError(f"{p}: missing (a router folder holds {JSON_NAME} and {NPZ_NAME}; "
                                          f"build one with `tandem router train`)")
        try:
            doc = json.loads(jpath.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RouterArtifactError(f"{jpath}: not valid JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != ARTIFACT_FORMAT:
            raise RouterArtifactError(f"{jpath}: not a tandem router artifact (format must be {ARTIFACT_FORMAT!r})")
        if doc.get("version") != ARTIFACT_VERSION:
            raise RouterArtifactError(
                f"{jpath}: artifact version {doc.get('version')!r} is not supported by this tandem "
                f"(expects version {ARTIFACT_VERSION}); retrain it with `tandem router train`")
        blob = npath.read_bytes()
        digest = hashlib.sha256(blob).hexdigest()
        if digest != doc.get("npz_sha256"):
            raise RouterArtifactError(
                f"{npath}: sha256 {digest[:16]}... does not match npz_sha256 recorded in {JSON_NAME}; the "
                f"weights were modified or belong to another artifact")
        try:
            with np.load(io.BytesIO(blob), allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
            fcfg = FeatureConfig.from_dict(doc["feature_config"])
            cal = doc["calibration"]
            if cal["method"] not in CALIBRATIONS:
                raise ValueError(f"calibration method {cal['method']!r} is not one of {CALIBRATIONS}")
            if doc.get("kind", "router") not in KINDS:
                raise ValueError(f"kind {doc.get('kind')!r} is not one of {KINDS}")
            ends = np.cumsum(arrays["calibration_sizes"])
            xs = np.split(arrays["calibration_x"], ends[:-1]) if ends.size else []
            ys = np.split(arrays["calibration_y"], ends[:-1]) if ends.size else []
            router = cls(
                feature_config=fcfg,
                dense_mean=arrays["dense_mean"], dense_scale=arrays["dense_scale"],
                coef=arrays["coef"], intercept=arrays["intercept"],
                calibration=Calibration(method=cal["method"], a=arrays["calibration_a"],
                                        b=arrays["calibration_b"], x=xs, y=ys),
                score_quantiles=np.asarray(doc["score_quantiles"], dtype=np.float64),
                threshold=float(doc["threshold"]),
                target_large_fraction=doc.get("target_large_fraction"),
                kind=doc.get("kind", "router"),
                metadata=doc.get("metadata") or {},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise RouterArtifactError(f"{folder}: malformed router artifact ({type(e).__name__}: {e})") from None
        router._check_shapes(folder)
        return router

    def _check_shapes(self, folder: Path) -> None:
        cfg = self.feature_config
        k = self.intercept.size
        where = folder / NPZ_NAME
        for name, n in {"dense_mean": cfg.num_dense, "dense_scale": cfg.num_dense,
                        "score_quantiles": NUM_QUANTILES}.items():
            if getattr(self, name).shape != (n,):
                raise RouterArtifactError(f"{where}: {name} has shape {getattr(self, name).shape}, the feature "
                                          f"config needs ({n},)")
        if self.coef.shape != (k, cfg.num_dense + cfg.num_hashed):
            raise RouterArtifactError(f"{where}: coef has shape {self.coef.shape}, the feature config needs "
                                      f"({k}, {cfg.num_dense + cfg.num_hashed})")
        cal = self.calibration
        if cal.method == "sigmoid" and (cal.a.shape != (k,) or cal.b.shape != (k,)):
            raise RouterArtifactError(f"{where}: sigmoid calibration needs one (a, b) per fold model ({k})")
        if cal.method == "isotonic" and (len(cal.x) != k or any(x.size < 1 or x.shape != y.shape
                                                                for x, y in zip(cal.x, cal.y))):
            raise RouterArtifactError(f"{where}: isotonic calibration tables are empty, ragged or not one per fold")
        if np.any(self.dense_scale <= 0):
            raise RouterArtifactError(f"{where}: dense_scale must be positive")
