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


# ---- policy comparison with bootstrap intervals ------------------------------------------------------------
ALL_COSTS = tuple(round(0.05 * i, 2) for i in range(0, 21))  # the curve the tables and the plot show


@dataclass
class PolicyCurve:
    policy: str
    apgr: float
    apgr_ci: tuple[float, float]
    cpt50: float
    cpt80: float
    costs: list[float]  # fraction of prompts sent to (or escalated to) the large model
    quality: list[float]  # mean quality at each cost
    quality_ci: list[tuple[float, float]]
    relative: list[float]  # quality / always-large quality
    relative_ci: list[tuple[float, float]]  # of each resample's quality / its own always-large quality
    cost_for_95: float | None  # least cost whose quality reaches 95% of always-large's (None: never)

    def to_dict(self) -> dict:
        return asdict(self)


def _curves(order_scores: np.ndarray, gain: np.ndarray, weights: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """Routed-minus-small quality sum per resample at each cost: [B, len(costs)] (weights [B, n])."""
    order = np.argsort(-order_scores, kind="stable")
    w = weights[:, order]
    cw = np.cumsum(w, axis=1)
    cg = np.cumsum(w * gain[order], axis=1)
    total = cw[:, -1:]
    out = np.zeros((w.shape[0], costs.size))
    for j, c in enumerate(costs):
        # the prompts whose cumulative weight is within c of the total go large
        k = np.sum(cw <= c * total + 1e-9, axis=1)
        out[:, j] = np.where(k > 0, np.take_along_axis(cg, np.maximum(k - 1, 0)[:, None], 1)[:, 0], 0.0)
    return out


def compare_policies(policies: dict[str, np.ndarray], small: np.ndarray, large: np.ndarray,
                     groups: list | None = None, bootstrap: int = 500, seed: int = 0,
                     costs: tuple[float, ...] = ALL_COSTS) -> dict[str, PolicyCurve]:
    """Each policy's quality-vs-cost curve (higher score = large first), APGR and CPT, with 95% bootstrap
    intervals (resampling groups, e.g. modules, when given: prompts of one module are not independent).
    `random` and `oracle` are added; always-small / always-large are the curve's two ends."""
    small, large = np.asarray(small, float), np.asarray(large, float)
    n = small.size
    rng = np.random.default_rng(seed)
    if groups is not None:
        _, gid = np.unique(np.asarray([str(g) for g in groups]), return_inverse=True)
        counts = rng.multinomial(gid.max() + 1, np.full(gid.max() + 1, 1.0 / (gid.max() + 1)), size=bootstrap)
        weights = np.vstack([np.ones(n), counts[:, gid]])
    else:
        weights = np.vstack([np.ones(n), rng.multinomial(n, np.full(n, 1.0 / n), size=bootstrap)])
    gain = large - small
    q_small = weights @ small / weights.sum(1)
    q_large = weights @ large / weights.sum(1)
    span = q_large - q_small
    cost_arr = np.asarray(costs, float)
    point_idx = [int(np.argmin(np.abs(cost_arr - c))) for c in COST_POINTS]
    all_policies = dict(policies)
    all_policies["oracle"] = gain
    out = {}
    for name, scores in list(all_policies.items()) + [("random", None)]:
        if scores is None:
            routed = cost_arr[None, :] * (q_large - q_small)[:, None]  # expected value of a random split
        else:
            routed = _curves(np.asarray(scores, float), gain, weights, cost_arr) / weights.sum(1, keepdims=True)
        quality = q_small[:, None] + routed
        with np.errstate(divide="ignore", invalid="ignore"):  # a resample where both models tie: no PGR
            pgr = routed / span[:, None]
        apgr = np.array([apgr_from_points(COST_POINTS, list(p[point_idx])) for p in pgr])
        lo, hi = np.nanpercentile(apgr[1:], [2.5, 97.5]) if bootstrap else (apgr[0], apgr[0])
        qlo, qhi = (np.percentile(quality[1:], [2.5, 97.5], axis=0) if bootstrap else (quality[0], quality[0]))
        rel = quality[0] / q_large[0]
        with np.errstate(divide="ignore", invalid="ignore"):
            rel_all = quality[1:] / q_large[1:, None]
        rlo, rhi = (np.nanpercentile(rel_all, [2.5, 97.5], axis=0) if bootstrap else (rel, rel))
        reach = np.flatnonzero(rel >= 0.95 - 1e-12)
        if scores is None:
            cpt50, cpt80 = 0.5, 0.8
        else:
            cpt50 = cost_to_reach(scores, small, large, 0.5)
            cpt80 = cost_to_reach(scores, small, large, 0.8)
        out[name] = PolicyCurve(
            policy=name, apgr=float(apgr[0]), apgr_ci=(float(lo), float(hi)), cpt50=cpt50, cpt80=cpt80,
            costs=[float(c) for c in cost_arr], quality=[float(v) for v in quality[0]],
            quality_ci=[(float(a), float(b)) for a, b in zip(qlo, qhi)], relative=[float(v) for v in rel],
            relative_ci=[(float(a), float(b)) for a, b in zip(rlo, rhi)],
            cost_for_95=float(cost_arr[reach[0]]) if reach.size else None)
    return out


def format_comparison(curves: dict[str, PolicyCurve], metric: str, small: float, large: float) -> str:
    """Quality (% of always-large) at every 10% cost point per policy, then APGR [95% CI], CPT, cost for 95%."""
    costs = [c for c in next(iter(curves.values())).costs]
    show = [i for i, c in enumerate(costs) if abs(c * 10 - round(c * 10)) < 1e-9]
    lines = [f"quality = {metric}: always-small {small:.4f}, always-large {large:.4f} "
             f"(small = {small / large:.1%} of large)",
             "quality as % of always-large at each cost (share of prompts the large model answers)",
             f"{'policy':<22}" + "".join(f"{int(round(costs[i] * 100)):>7d}" for i in show)]
    for name, c in curves.items():
        lines.append(f"{name:<22}" + "".join(f"{c.relative[i]:7.1%}" for i in show))
    lines += ["", f"{'policy':<22} {'APGR':>6} {'95% CI':>15} {'CPT(50%)':>9} {'CPT(80%)':>9} {'cost @95%':>10}"]
    for name, c in curves.items():
        reach = f"{c.cost_for_95:.0%}" if c.cost_for_95 is not None else "never"
        lines.append(f"{name:<22} {c.apgr:6.3f} [{c.apgr_ci[0]:5.3f}, {c.apgr_ci[1]:5.3f}] {c.cpt50:9.1%} "
                     f"{c.cpt80:9.1%} {reach:>10}")
    lines.append(f"{'always-small':<22} cost 0%, PGR 0; {'always-large'} cost 100%, PGR 1")
    return "\n".join(lines)
