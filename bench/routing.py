"""Quality vs cost of routing policies on the held-out test modules of the default models (task success).

Labels come from `tandem router label` (models/router/labels/test.jsonl.gz): for each prompt (a window of an
unseen module ending at a line boundary), both models' greedy completion of the line through the engine, scored
by exact match (EM) and edit similarity against the true line. Policies, at every cost point (share of prompts
the large model answers): the router (prompt only, before any model runs), the cascade with the learned
escalation scorer (prompt + small answer + its logprob statistics) and with the raw confidence (mean / min token
logprob of the small answer), random, always-small, always-large and the oracle. A cascade escalated on a prompt
answers with the large model's greedy answer (the gateway's verification returns exactly that), so its quality
there is the large model's; it also paid for the small answer. 95% bootstrap intervals resample modules.
Prints the tables, writes bench/results/routing.json and docs/img/routing_quality_cost.png.

    .venv/bin/python bench/routing.py [--router models/router] [--cascade models/router/cascade]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402
from router_model.cli import policy_scores  # noqa: E402
from router_model.data import parse_example, read_rows  # noqa: E402
from router_model.evaluate import compare_policies, format_comparison  # noqa: E402
from router_model.router import Router  # noqa: E402

METRICS = {"exact": "exact match", "edit": "edit similarity"}
STYLE = {"router": ("C0", "-"), "cascade (learned)": ("C3", "-"), "cascade (mean logprob)": ("C1", "--"),
         "cascade (min logprob)": ("C4", "--"), "oracle": ("grey", ":"), "random": ("k", ":")}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.0 * len(results), 4.6))
    for ax, (metric, curves) in zip(np.atleast_1d(axes), results.items()):
        q_large = curves["random"]["quality"][-1]
        for name, c in curves.items():
            color, ls = STYLE.get(name, ("C5", "-"))
            x = np.array(c["costs"]) * 100
            y = np.array(c["quality"]) / q_large * 100
            ax.plot(x, y, ls=ls, color=color, lw=1.6 if name in ("router", "cascade (learned)") else 1.0,
                    label=f"{name} (APGR {c['apgr']:.2f})" if name != "random" else "random (APGR 0.50)")
            if name in ("router", "cascade (learned)"):
                lo = np.array([v[0] for v in c["relative_ci"]]) * 100
                hi = np.array([v[1] for v in c["relative_ci"]]) * 100
                ax.fill_between(x, lo, hi, color=color, alpha=0.12, lw=0)
        ax.scatter([0, 100], [curves["random"]["quality"][0] / q_large * 100, 100], color="k", marker="s", zorder=5,
                   label="always-small / always-large")
        ax.axhline(95, ls="--", lw=0.7, color="grey")
        ax.axvline(50, ls="--", lw=0.7, color="grey")
        ax.set_ylim(min(40, curves["random"]["quality"][0] / q_large * 100 - 5), 125)
        ax.set_xlabel("cost: prompts answered by the large model (%)")
        ax.set_ylabel(f"{METRICS.get(metric, metric)} (% of always-large)")
        ax.set_title(f"held-out test modules: {METRICS.get(metric, metric)}")
        ax.legend(loc="lower right", fontsize=7)
    fig.suptitle("tandem routing, default tiny pair, line completion (bands: 95% bootstrap over modules of the "
                 "quality relative to always-large)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--router", default=str(ROOT / "models/router"))
    ap.add_argument("--cascade", default=str(ROOT / "models/router/cascade"))
    ap.add_argument("--data", default=str(ROOT / "models/router/labels/test.jsonl.gz"))
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--out", default=str(ROOT / "bench/results/routing.json"))
    ap.add_argument("--plot", default=str(ROOT / "docs/img/routing_quality_cost.png"))
    args = ap.parse_args(argv)

    rows = read_rows(args.data)
    examples = [parse_example(r, f"{args.data}:{i}") for i, r in enumerate(rows, 1)]
    router, cascade = Router.load(args.router), Router.load(args.cascade)
    policies = policy_scores(rows, examples, router, cascade)
    groups = [ex.group for ex in examples]
    results = {}
    print(f"{len(rows)} prompts from {len(set(groups))} held-out test modules ({args.data}); router {args.router}; "
          f"escalation scorer {args.cascade}; {args.bootstrap} bootstrap resamples of modules")
    for metric in METRICS:
        small = np.array([r[f"small_{metric}"] for r in rows], float)
        large = np.array([r[f"large_{metric}"] for r in rows], float)
        curves = compare_policies(policies, small, large, groups, bootstrap=args.bootstrap)
        results[metric] = {k: v.to_dict() for k, v in curves.items()}
        print()
        print(format_comparison(curves, METRICS[metric], float(small.mean()), float(large.mean())))
    em = results["exact"]
    r, c = em["router"], em["cascade (learned)"]
    checks = {
        "router APGR >= 0.80 (EM)": r["apgr"] >= 0.80,
        "router CPT(50%) <= 20% (EM)": r["cpt50"] <= 0.20,
        "learned cascade APGR >= router APGR (EM)": c["apgr"] >= r["apgr"],
        "some setting >= 95% of always-large EM with <= 50% large calls": any(
            v["cost_for_95"] is not None and v["cost_for_95"] <= 0.5 for k, v in em.items()
            if k not in ("oracle", "random")),
    }
    print()
    for k, ok in checks.items():
        print(f"{'met' if ok else 'NOT met'}: {k}")
    settings = {k: v["cost_for_95"] for k, v in em.items() if k not in ("oracle", "random")}
    print("least cost reaching 95% of always-large EM: " + "; ".join(
        f"{k} {'never' if v is None else f'{v:.0%}'}" for k, v in settings.items()))
    out = Path(args.out)
    write_results(out, {"data": args.data, "router": args.router, "cascade": args.cascade,
                               "num_prompts": len(rows), "num_modules": len(set(groups)),
                               "bootstrap": args.bootstrap, "checks": checks, "results": results}, indent=2)
    plot_path = Path(args.plot)
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    plot(results, plot_path)
    print(f"wrote {out} and {plot_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
