"""The trained router at serve time: a linear model over `Featurizer` features plus a probability calibration.

Owns the artifact format (router.json + router.npz, never pickle; the JSON records a version and the npz's
sha256, both checked on load) and numpy-only inference: `score` -> P(large needed), `decide` -> route choice.
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
ARTIFACT_VERSION = 1
JSON_NAME = "router.json"
NPZ_NAME = "router.npz"
CALIBRATIONS = ("sigmoid", "isotonic")
# 0..100th percentiles of the calibrated score on held-out data: maps a target large fraction to a threshold.
NUM_QUANTILES = 101


class RouterArtifactError(ValueError):
    """A router folder that cannot be loaded; the message names the file and what is wrong with it."""


class MissingExtraFeature(ValueError):
    """The router was trained with an extra feature (e.g. the small model's prompt log-prob) not supplied."""


@dataclass
class Calibration:
    """Raw linear margin z -> probability. sigmoid: 1/(1+exp(a*z+b)) (Platt); isotonic: clipped interpolation."""

    method: str
    a: float = -1.0
    b: float = 0.0
    x: np.ndarray = field(default_factory=lambda: np.zeros(0))
    y: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def __call__(self, z: np.ndarray | float) -> np.ndarray:
        z = np.asarray(z, dtype=np.float64)
        if self.method == "sigmoid":
            t = np.clip(self.a * z + self.b, -500.0, 500.0)
            return 1.0 / (1.0 + np.exp(t))
        return np.interp(z, self.x, self.y)


@dataclass
class Router:
    feature_config: FeatureConfig
    dense_mean: np.ndarray  # standardisation of the dense part (stats, extras) learnt on the training set
    dense_scale: np.ndarray
    coef_dense: np.ndarray
    coef_hashed: np.ndarray
    intercept: float
    calibration: Calibration
    score_quantiles: np.ndarray  # [NUM_QUANTILES] calibrated scores on held-out data, ascending (in the JSON)
    threshold: float = 0.5
    target_large_fraction: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # the hashed weights are stored as float32; hold exactly those values so a saved copy scores the same
        self.coef_hashed = np.asarray(self.coef_hashed, dtype=np.float32).astype(np.float64)
        self.featurizer = Featurizer(self.feature_config)

    # ---- inference -------------------------------------------------------------------------------------
    @property
    def required_extras(self) -> tuple[str, ...]:
        """Extra feature names the caller must pass to `score` (empty for a text-only router)."""
        return self.feature_config.extras

    def features(self, x: Conversation, extras: Mapping[str, float] | None = None) -> PromptFeatures:
        feats = self.featurizer(x, extras)
        if feats.extras_missing:
            raise MissingExtraFeature(
                f"this router needs extra feature(s) {', '.join(feats.extras_missing)} "
                f"(pass extras={{name: value}}; e.g. small_prompt_logprob from the small model's prefill)")
        return feats

    def margin_of(self, feats: PromptFeatures) -> float:
        """The raw linear score (log-odds before calibration)."""
        dense = (feats.dense - self.dense_mean) / self.dense_scale
        return float(self.intercept + dense @ self.coef_dense + feats.values @ self.coef_hashed[feats.indices])

    def score(self, x: Conversation, extras: Mapping[str, float] | None = None) -> float:
        """P(the large model is needed) for a prompt string or a list of OpenAI-style messages."""
        return float(self.calibration(self.margin_of(self.features(x, extras))))

    def decide(self, x: Conversation, threshold: float | None = None,
               extras: Mapping[str, float] | None = None) -> tuple[str, float]:
        """("large" | "small", score): large when the score reaches the threshold (the artifact's by default)."""
        s = self.score(x, extras)
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
        arrays = {
            "dense_mean": self.dense_mean.astype(np.float64),
            "dense_scale": self.dense_scale.astype(np.float64),
            "coef_dense": self.coef_dense.astype(np.float64),
            "coef_hashed": self.coef_hashed.astype(np.float32),
            "calibration_x": np.asarray(self.calibration.x, dtype=np.float64),
            "calibration_y": np.asarray(self.calibration.y, dtype=np.float64),
        }
        buf = io.BytesIO()
        np.savez_compressed(buf, **arrays)
        blob = buf.getvalue()
        (folder / NPZ_NAME).write_bytes(blob)
        doc = {
            "format": ARTIFACT_FORMAT,
            "version": ARTIFACT_VERSION,
            "npz_sha256": hashlib.sha256(blob).hexdigest(),
            "feature_config": self.feature_config.to_dict(),
            "intercept": self.intercept,
            "calibration": {"method": self.calibration.method, "a": self.calibration.a, "b": self.calibration.b},
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
            router = cls(
                feature_config=fcfg,
                dense_mean=arrays["dense_mean"], dense_scale=arrays["dense_scale"],
                coef_dense=arrays["coef_dense"], coef_hashed=arrays["coef_hashed"].astype(np.float64),
                intercept=float(doc["intercept"]),
                calibration=Calibration(method=cal["method"], a=float(cal["a"]), b=float(cal["b"]),
                                        x=arrays["calibration_x"], y=arrays["calibration_y"]),
                score_quantiles=np.asarray(doc["score_quantiles"], dtype=np.float64),
                threshold=float(doc["threshold"]),
                target_large_fraction=doc.get("target_large_fraction"),
                metadata=doc.get("metadata") or {},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise RouterArtifactError(f"{folder}: malformed router artifact ({type(e).__name__}: {e})") from None
        router._check_shapes(folder)
        return router

    def _check_shapes(self, folder: Path) -> None:
        cfg = self.feature_config
        expected = {"dense_mean": cfg.num_dense, "dense_scale": cfg.num_dense, "coef_dense": cfg.num_dense,
                    "coef_hashed": cfg.num_hashed, "score_quantiles": NUM_QUANTILES}
        for name, n in expected.items():
            arr = getattr(self, name)
            if arr.shape != (n,):
                raise RouterArtifactError(f"{folder / NPZ_NAME}: {name} has shape {arr.shape}, the feature "
                                          f"config needs ({n},)")
        if self.calibration.method == "isotonic" and (self.calibration.x.size < 1
                                                      or self.calibration.x.shape != self.calibration.y.shape):
            raise RouterArtifactError(f"{folder / NPZ_NAME}: isotonic calibration table is empty or ragged")
        if np.any(self.dense_scale <= 0):
            raise RouterArtifactError(f"{folder / NPZ_NAME}: dense_scale must be positive")
