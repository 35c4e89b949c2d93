"""Labels from the models themselves, for `tandem router adapt`: both engines answer unlabelled prompts (offline
engine API, greedy, batched, cached on disk), and the pair's agreement (router_model.scoring.agreement, the one
the gateway's shadow runs store) is the label. `LabelModel` reads what a disagreement means: fitted on the
shipped artifact's reference-labelled data, it maps a pair (agreement, edit similarity, the small answer's logprob
statistics, lengths) to P(the large model is right where the small one is wrong), the quantity the router and
the escalation scorer predict. Agreeing pairs score alike under exact match, so they stay 0.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from router_model.scoring import ANSWER_STATS, ENTROPY_TOP_K, agreement, answer_stats

PAIR_FEATURES = ("disagree_first_line", "edit_distance", *ANSWER_STATS, "log_small_chars", "log_large_chars")


def _key(prompt: Any, small: str, large: str, max_tokens: int, stop: Sequence[str]) -> str:
    doc = json.dumps([prompt, Path(small).name, Path(large).name, max_tokens, list(stop)], sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:32]


def _engine_answers(model_dir: str, prompts: list, max_tokens: int, stop: Sequence[str], batch: int, log,
                    **engine_options) -> list[dict]:
    """{answer, stats} per prompt from one engine, `batch` prompts per generate call (top-5 logprobs on)."""
    from engines import SamplingParams
    from router_model.user_labels import labelling_engine

    llm, texts = labelling_engine(model_dir, prompts, **engine_options)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=list(stop), logprobs=ENTROPY_TOP_K)
    out = []
    t0 = time.perf_counter()
    for b in range(0, len(texts), batch):
        for o in llm.generate(texts[b:b + batch], params):
            c = o.outputs[0]
            pieces = [llm.tokenizer.decode([t], skip_special_tokens=False) for t in c.token_ids]
            out.append({"answer": c.text, "stats": {k: round(v, 5) for k, v in answer_stats(
                c.token_ids, c.logprobs, pieces).items()}, "tokens": len(c.token_ids)})
        log(f"  {Path(model_dir).name}: {len(out)}/{len(texts)} prompts ({time.perf_counter() - t0:.0f}s)")
    return out


def answer_pairs(prompts: list, small: str, large: str, *, max_tokens: int, stop: Sequence[str] = (),
                 batch: int = 256, cache: str | Path | None = None, log=print, **engine_options) -> list[dict]:
    """Both engines' greedy answers to every prompt: {small_answer, large_answer, small_answer_stats,
    large_answer_stats, agreement}; pairs already in the `cache` JSONL (keyed by prompt, models, budget) are
    not asked again, new ones are appended to it."""
    keys = [_key(p, small, large, max_tokens, stop) for p in prompts]
    known: dict[str, dict] = {}
    cache_path = Path(cache) if cache else None
    if cache_path is not None and cache_path.is_file():
        with cache_path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    known[row["key"]] = row
    distinct = {k: i for i, k in reversed(list(enumerate(keys)))}  # one run per distinct prompt
    todo = sorted(i for k, i in distinct.items() if k not in known)
    if todo:
        log(f"answering {len(todo)} distinct prompts on both engines ({len(distinct) - len(todo)} cached)")
        asked = [prompts[i] for i in todo]
        s = _engine_answers(small, asked, max_tokens, stop, batch, log, **engine_options)
        g = _engine_answers(large, asked, max_tokens, stop, batch, log, **engine_options)
        fresh = []
        for i, a, b in zip(todo, s, g):
            row = {"key": keys[i], "small_answer": a["answer"], "large_answer": b["answer"],
                   "small_answer_stats": a["stats"], "large_answer_stats": b["stats"],
                   "small_tokens": a["tokens"], "large_tokens": b["tokens"]}
            known[keys[i]] = row
            fresh.append(row)
        if cache_path is not None:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            with cache_path.open("a", encoding="utf-8") as f:
                for row in fresh:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
    out = []
    for k in keys:
        row = dict(known[k])
        row["agreement"] = agreement(row["small_answer"], row["large_answer"])
        out.append(row)
    return out


def pair_features(label: Mapping[str, float], small_stats: Mapping[str, float] | None, small_chars: int,
                  large_chars: int) -> np.ndarray:
    """What the label model reads of one pair (PAIR_FEATURES): no reference, only the two answers."""
    stats = small_stats or {}
    doubtful = {"answer_mean_logprob": -20.0, "answer_min_logprob": -20.0, "answer_first_line_logprob": -20.0,
                "answer_entropy": 5.0, "answer_log_tokens": 0.0}
    return np.array([1.0 - float(label["first_line_exact"]), 1.0 - float(label["edit_similarity"]),
                     *[float(stats.get(k, doubtful[k])) for k in ANSWER_STATS],
                     math.log1p(small_chars), math.log1p(large_chars)])


@dataclass
class LabelModel:
    """P(large right, small wrong | a disagreeing pair): a logistic regression over PAIR_FEATURES (standardised),
    fitted on reference-labelled rows; agreeing pairs are 0 (the two answers score the same)."""

    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray
    intercept: float
    fitted_on: int = 0
    positive_rate: float = 0.0

    def __call__(self, feats: np.ndarray) -> np.ndarray:
        feats = np.atleast_2d(feats)
        z = ((feats - self.mean) / self.scale) @ self.coef + self.intercept
        p = 1.0 / (1.0 + np.exp(-np.clip(z, -50, 50)))
        return np.where(feats[:, 0] > 0.5, p, 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"features": list(PAIR_FEATURES), "mean": self.mean.tolist(), "scale": self.scale.tolist(),
                "coef": self.coef.tolist(), "intercept": self.intercept, "fitted_on": self.fitted_on,
                "positive_rate": self.positive_rate}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LabelModel:
        if list(d.get("features", ())) != list(PAIR_FEATURES):
            raise ValueError(f"label model reads {d.get('features')}, this tandem computes {list(PAIR_FEATURES)}")
        return cls(np.asarray(d["mean"], float), np.asarray(d["scale"], float), np.asarray(d["coef"], float),
                   float(d["intercept"]), int(d.get("fitted_on", 0)), float(d.get("positive_rate", 0.0)))

    @classmethod
    def fit(cls, rows: Sequence[Mapping[str, Any]], c: float = 1.0) -> LabelModel:
        """From rows with both answers, the small answer's statistics and both references' scores (the shipped
        label files hold all of them): the target is large_score > small_score, over disagreeing pairs."""
        from sklearn.linear_model import LogisticRegression

        feats, y = [], []
        for r in rows:
            if "small_answer" not in r or "large_answer" not in r:
                continue
            label = agreement(r["small_answer"], r["large_answer"])
            if label["first_line_exact"] >= 0.5:
                continue
            feats.append(pair_features(label, r.get("small_answer_stats"), len(r["small_answer"]),
                                       len(r["large_answer"])))
            y.append(int(float(r["large_score"]) > float(r["small_score"])))
        y_arr = np.asarray(y)
        if len(y) < 20 or y_arr.min() == y_arr.max():
            raise ValueError(f"{len(y)} disagreeing reference pairs ({int(y_arr.sum()) if y else 0} large-only "
                             f"right) are too few to fit the label model")
        x = np.asarray(feats)
        mean, scale = x.mean(0), x.std(0)
        scale[scale < 1e-9] = 1.0
        lr = LogisticRegression(C=c, max_iter=2000).fit((x - mean) / scale, y_arr)
        return cls(mean, scale, lr.coef_.ravel(), float(lr.intercept_[0]), len(y), float(y_arr.mean()))

    def label(self, pair: Mapping[str, Any]) -> float:
        """P(large needed) of one answered pair (`answer_pairs` row, or a shadow record with stats)."""
        feats = pair_features(pair["agreement"], pair.get("small_answer_stats"),
                              pair.get("small_chars", len(pair.get("small_answer", ""))),
                              pair.get("large_chars", len(pair.get("large_answer", ""))))
        return float(self(feats)[0])
