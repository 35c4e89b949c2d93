"""Router evaluation the RouteLLM way: PGR at cost points, APGR, CPT(x), next to random / always-small / -large.

Cost = fraction of calls sent to the large model. At cost c the router sends the round(c*n) highest-scoring
prompts to the large model; PGR(c) = (q_routed - q_small) / (q_large - q_small) with q = mean quality.
APGR is the area under PGR over cost in [0, 1] (trapezoids through PGR(0) = 0 and 10 points), so random = 0.5.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

COST_POINTS = tuple(round(0.1 * i, 1) for i in range(1, 11))


@dataclass
class RouterEval:
    n: int
    quality_small: float
    quality_large: float
    costs: list[float]
    pgr: list[float]  # router PGR at each cost point
    apgr: float
    cpt50: float  # smallest cost (fraction of large calls) reaching PGR >= 0.5
    cpt80: float
    oracle_apgr: float  # the best any router could do on these qualities (for context)

    def to_dict(self) -> dict:
        return asdict(self)


def pgr_all_k(scores: np.ndarray, small: np.ndarray, large: np.ndarray) -> np.ndarray:
    """PGR when the top-k prompts by score go large, for every k = 0..n (ties broken by input order)."""
    scores, small, large = (np.asarray(a, dtype=np.float64) for a in (scores, small, large))
    n = scores.size
    if n == 0:
        raise ValueError("no examples to evaluate")
    order = np.argsort(-scores, kind="stable")
    gain = (large - small)[order]
    q_small, q_large = small.mean(), large.mean()
    span = q_large - q_small
    if span == 0:
        raise ValueError("the large and small models have the same mean quality on this data: PGR is undefined")
    routed = q_small + np.concatenate([[0.0], np.cumsum(gain)]) / n
    return (routed - q_small) / span


def pgr_at(scores: np.ndarray, small: np.ndarray, large: np.ndarray,
           costs: tuple[float, ...] = COST_POINTS) -> list[float]:
    curve = pgr_all_k(scores, small, large)
    n = curve.size - 1
    return [float(curve[int(round(c * n))]) for c in costs]


def apgr_from_points(costs: tuple[float, ...] | list[float], pgr: list[float]) -> float:
    """Trapezoid area under PGR(cost) from (0, 0) through the given points (which must end at cost 1)."""
    xs = np.concatenate([[0.0], np.asarray(costs, dtype=np.float64)])
    ys = np.concatenate([[0.0], np.asarray(pgr, dtype=np.float64)])
    return float(np.sum((xs[1:] - xs[:-1]) * (ys[1:] + ys[:-1]) / 2.0))


def cost_to_reach(scores: np.ndarray, small: np.ndarray, large: np.ndarray, target_pgr: float) -> float:
    """CPT: the smallest fraction of large calls whose PGR reaches `target_pgr` (1.0 if only all-large does)."""
    curve = pgr_all_k(scores, small, large)
    hit = np.flatnonzero(curve >= target_pgr - 1e-12)
    k = int(hit[0]) if hit.size else curve.size - 1
    return k / (curve.size - 1)


def evaluate_scores(scores: np.ndarray, small: np.ndarray, large: np.ndarray) -> RouterEval:
    scores, small, large = (np.asarray(a, dtype=np.float64) for a in (scores, small, large))
    pgr = pgr_at(scores, small, large)
    oracle = large - small
    return RouterEval(
        n=int(scores.size), quality_small=float(small.mean()), quality_large=float(large.mean()),
        costs=list(COST_POINTS), pgr=pgr, apgr=apgr_from_points(COST_POINTS, pgr),
        cpt50=cost_to_reach(scores, small, large, 0.5), cpt80=cost_to_reach(scores, small, large, 0.8),
        oracle_apgr=apgr_from_points(COST_POINTS, pgr_at(oracle, small, large)),
    )


def format_report(ev: RouterEval, title: str = "router") -> str:
    """The printed table: PGR per cost point for router / random, then APGR and CPT for every policy."""
    head = "cost (% large)   " + " ".join(f"{int(round(c * 100)):>6d}" for c in ev.costs)
    rows = [
        f"{ev.n} prompts; mean quality: small {ev.quality_small:.4f}, large {ev.quality_large:.4f}",
        "",
        "PGR at each cost point",
        head,
        f"{title:<16} " + " ".join(f"{p:6.3f}" for p in ev.pgr),
        f"{'random':<16} " + " ".join(f"{c:6.3f}" for c in ev.costs),
        "",
        f"{'policy':<16} {'cost':>7} {'APGR':>7} {'CPT(50%)':>9} {'CPT(80%)':>9}",
        f"{title:<16} {'-':>7} {ev.apgr:7.3f} {ev.cpt50:9.1%} {ev.cpt80:9.1%}",
        f"{'random':<16} {'-':>7} {0.5:7.3f} {0.5:9.1%} {0.8:9.1%}",
        f"{'always-small':<16} {0.0:7.0%} {'-':>7} {'-':>9} {'-':>9}   (PGR 0)",
        f"{'always-large':<16} {1.0:7.0%} {'-':>7} {'-':>9} {'-':>9}   (PGR 1)",
        f"{'oracle':<16} {'-':>7} {ev.oracle_apgr:7.3f} {'':>9} {'':>9}   (upper bound on this data)",
    ]
    return "\n".join(rows)
