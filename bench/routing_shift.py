"""The traffic-shift experiment end to end: the shipped router and learned cascade vs the ones `tandem router
adapt` makes from N unlabelled prompts of shifted traffic, on an evaluation set of the same shift that nobody
adapted on, labelled by references (bench/routing_shift_data.py: the modules of a package family, default
pygments, `--family httpx,httpcore` for several packages; transformers greedy, line exact match).

For each N (default 250, 500, 1000, 2000 prompts of the traffic side, in a fixed random order), adaptation runs
as the command does (both engines answer, greedy, batched; pairs cached under bench/cache/routing_shift/); then
on the evaluation modules: APGR of each router / cascade with 95% bootstrap intervals over modules, and the
realised large fraction for a 30% target, with the artifact's static threshold and with the route's held one
(gateway.route_monitor.RouteMonitor over the evaluation stream, window 1,000). Prints the table, writes
bench/results/routing_shift.json (pygments) or bench/results/routing_shift_FAMILY.json (keyed by family).

    .venv/bin/python bench/routing_shift.py [--family PKG[,PKG]] [--sizes 250 500 1000 2000] [--bootstrap 1000]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import bench.routing_shift_data as shift_data  # noqa: E402
from bench.results_meta import write_results  # noqa: E402
from bench.routing_shift_data import ANSWER_BUDGET, DEFAULT_FAMILY, cache_dir, ensure, family_key, read_jsonl  # noqa: E402
from gateway.route_monitor import RouteMonitor  # noqa: E402
from router_model.adapt_cli import parser as adapt_parser  # noqa: E402
from router_model.adapt_cli import run as adapt_run  # noqa: E402
from router_model.cli import policy_scores  # noqa: E402
from router_model.data import parse_example, read_rows  # noqa: E402
from router_model.evaluate import compare_policies  # noqa: E402
from router_model.features import FeatureConfig  # noqa: E402
from router_model.prompt_stats import PROMPT_EXTRAS, PromptStats, needs_prompt_stats  # noqa: E402
from router_model.router import Router  # noqa: E402

TARGET = 0.3


def held_fraction(scores: np.ndarray, static: float, quantiles, seed: int = 0) -> float:
    """The realised large share of a router route holding TARGET over this stream (after its warm-up window)."""
    mon = RouteMonitor("shift", static_threshold=static, target_fraction=TARGET, reference_quantiles=list(quantiles),
                       window=1000, warmup=100, rng=random.Random(seed))
    order = np.random.default_rng(seed).permutation(scores.size)
    choices = [mon.decide(float(scores[i])) for i in order]
    return float(np.mean(choices[1000:] if len(choices) > 2000 else choices[100:]))


def evaluate(router: Router, cascade: Router, rows: list[dict], examples, bootstrap: int) -> dict:
    pol = policy_scores(rows, examples, router, cascade)
    small = np.array([r["small_exact"] for r in rows], float)
    large = np.array([r["large_exact"] for r in rows], float)
    curves = compare_policies({"router": pol["router"], "cascade (learned)": pol["cascade (learned)"]}, small,
                              large, [r["group"] for r in rows], bootstrap=bootstrap)
    out = {name: {"apgr": c.apgr, "apgr_ci": c.apgr_ci, "cpt50": c.cpt50, "cpt80": c.cpt80}
           for name, c in curves.items() if name in ("router", "cascade (learned)", "oracle")}
    out["router"]["static_large_fraction"] = float(np.mean(pol["router"] >= router.threshold))
    out["router"]["held_large_fraction"] = held_fraction(pol["router"], router.threshold, router.score_quantiles)
    out["cascade (learned)"]["static_escalated_fraction"] = float(np.mean(pol["cascade (learned)"] >=
                                                                          cascade.threshold))
    return out


def ceiling(base: Router, scorer: Router, args, cache: Path, rows, examples, held=None) -> dict:
    """The bound on what adaptation of these features can reach: the refit fed the traffic side's *reference*
    labels (large right where the small is wrong; transformers, as the evaluation's) instead of self-labels,
    on the same prompts and with the same prior; scored on the evaluation modules, never fitted on."""
    from bench.routing_shift_data import build_prompts, reference_rows, write_jsonl
    from router_model.adapt import AdaptOptions, Traffic, refit
    from router_model.adapt_cli import add_prompt_stats

    path = cache / "traffic_refs.jsonl.gz"
    if not path.is_file():
        write_jsonl(path, reference_rows(build_prompts(Path(args.small), 2000, 0, family=args.family)["traffic"],
                                         Path(args.small), Path(args.large)))
    refs = read_jsonl(path)[:max(args.sizes)]
    router_t, scorer_t = Traffic(), Traffic()
    for r in refs:
        q = float(r["large_exact"] > r["small_exact"])
        router_t.add(r["prompt"], q, r["group"])
        scorer_t.add(r["prompt"], q, r["group"], r["small_answer"], r["small_answer_stats"])
    prior = read_jsonl(Path(base.metadata["data"]) if Path(base.metadata["data"]).is_absolute()
                       else ROOT / base.metadata["data"])
    opts = AdaptOptions(prior_share=0.3)
    router_prior = prior
    if needs_prompt_stats(base.feature_config.extras):
        router_prior = add_prompt_stats(base, prior, router_t, opts, argparse.Namespace(
            small=args.small, dtype="auto", prompt_stats_cache=str(shift_data.CACHE_ROOT / "prompt_stats.jsonl")))
    r, c = refit(base, router_prior, router_t, opts), refit(scorer, prior, scorer_t, opts)
    out = evaluate(r, c, rows, examples, args.bootstrap) | {"traffic_prompts": len(refs),
                                                             "large_only_right": int(sum(router_t.q))}
    if held is not None:
        out["heldout"] = evaluate(r, c, *held, args.bootstrap)
    return out


SHIPPED = None  # a variant's blocks: the shipped artifact's own
TAIL60 = {"view": "tail", "chars": 60, "ngrams": [1, 3], "buckets": 4096}
FEATURE_VARIANTS = {  # `--features NAME`: the router refitted on other features than the shipped artifact's
    # (blocks, extras)
    "tail60": ((TAIL60,), ()),  # the prompt's end, coarse
    "tail300": (({"view": "tail", "chars": 300, "ngrams": [2, 4], "buckets": 16384},), ()),  # more context, coarse
    # the small model's prefill of the prompt (router_model/prompt_stats.py) beside the shipped blocks, beside
    # the coarse tail, or with the text statistics only
    "prompt-lp": (SHIPPED, tuple(PROMPT_EXTRAS)),
    "tail60-lp": ((TAIL60,), tuple(PROMPT_EXTRAS)),
    "lp-only": ((), tuple(PROMPT_EXTRAS)),
}


def variant_config(name: str, cur: FeatureConfig) -> FeatureConfig:
    blocks, extras = FEATURE_VARIANTS[name]
    return FeatureConfig(blocks=cur.blocks if blocks is SHIPPED else blocks, stats=cur.stats, extras=extras)


def feature_template(shipped_dir: Path, name: str, dest: Path) -> Path:
    """An untrained router of the shipped kind, stats, calibration method, C, target and prior data, with the
    variant's hashed blocks and extras: `tandem router adapt --router` of it refits those features."""
    from router_model.router import NUM_QUANTILES, Calibration

    cur = Router.load(shipped_dir)
    cfg = variant_config(name, cur.feature_config)
    meta = {"data": str(ROOT / cur.metadata["data"]), "C": cur.metadata.get("C", 1.0),
            "trained_at": f"template {name}"}
    t = Router(feature_config=cfg, dense_mean=np.zeros(cfg.num_dense), dense_scale=np.ones(cfg.num_dense),
               coef=np.zeros((1, cfg.num_dense + cfg.num_hashed)), intercept=np.zeros(1),
               calibration=Calibration("sigmoid", a=np.array([-1.0]), b=np.array([0.0])), kind=cur.kind,
               score_quantiles=np.linspace(0, 1, NUM_QUANTILES), metadata=meta)
    t.target_large_fraction = cur.target_large_fraction
    t.save(dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--router", default=str(ROOT / "models/router"))
    ap.add_argument("--small", default=str(ROOT / "models/tandem-tiny-s"))
    ap.add_argument("--large", default=str(ROOT / "models/tandem-tiny-l"))
    ap.add_argument("--sizes", type=int, nargs="+", default=[250, 500, 1000, 2000])
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--family", default=DEFAULT_FAMILY, help="package(s) of the shifted set, comma-separated")
    ap.add_argument("--adapt-args", default="", help="extra `tandem router adapt` options for every size "
                    "(e.g. '--prior-share 0.1 --C 10'); the artifacts then go to a folder named by them")
    ap.add_argument("--features", choices=sorted(FEATURE_VARIANTS), default=None,
                    help="refit the router on these blocks instead of the shipped ones (the scorer: as shipped)")
    ap.add_argument("--ceiling", action="store_true", help="also refit on the traffic side's reference labels "
                    "(a bound, not an adaptation: references of the traffic are what a team never has)")
    ap.add_argument("--heldout", default=None, help="also score every router and cascade on this reference-labelled "
                    "file (e.g. models/router/labels/test.jsonl.gz: the original held-out split)")
    ap.add_argument("--out", default=None, help="default bench/results/routing_shift[_FAMILY].json")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    key = family_key(args.family)
    cache = cache_dir(args.family)
    if args.out is None:
        args.out = str(ROOT / "bench/results" / ("routing_shift.json" if key == DEFAULT_FAMILY
                                                 else f"routing_shift_{key}.json"))
    paths = ensure(Path(args.small), Path(args.large), family=args.family)
    rows = read_jsonl(paths["eval"])
    examples = [parse_example(r, f"eval:{i}") for i, r in enumerate(rows, 1)]
    shipped = (Router.load(args.router), Router.load(Path(args.router) / "cascade"))
    base = args.router
    if args.features:  # an untrained template of the variant's features
        base = str(feature_template(Path(args.router), args.features, cache / f"template_{args.features}"))
    prompt_stats = PromptStats(args.small, shift_data.CACHE_ROOT / "prompt_stats.jsonl")
    want_stats = needs_prompt_stats(Router.load(base).feature_config.extras)
    if want_stats:  # what the small engine's prefill of each evaluation prompt gives, as the router's extras
        for ex, st in zip(examples, prompt_stats([ex.conversation for ex in examples])):
            ex.extras |= st
    held = None
    if args.heldout:
        hrows = read_rows(args.heldout)
        held = (hrows, [parse_example(r, f"heldout:{i}") for i, r in enumerate(hrows, 1)])
        if want_stats:
            for ex, st in zip(held[1], prompt_stats([ex.conversation for ex in held[1]])):
                ex.extras |= st

    def score(r: Router, c: Router, tag: dict | None = None) -> dict:
        out = evaluate(r, c, rows, examples, args.bootstrap) | (tag or {})
        if held is not None:
            out["heldout"] = evaluate(r, c, *held, args.bootstrap)
        return out
    small = np.mean([r["small_exact"] for r in rows])
    large = np.mean([r["large_exact"] for r in rows])
    print(f"evaluation: {len(rows)} prompts from {len({r['group'] for r in rows})} {key} modules; exact match "
          f"small {small:.4f}, large {large:.4f}; large-only right "
          f"{sum(r['large_exact'] > r['small_exact'] for r in rows)}, small-only "
          f"{sum(r['small_exact'] > r['large_exact'] for r in rows)}")
    results = {"shipped": score(*shipped), "adapted": {}}
    if args.ceiling:
        results["ceiling (reference-labelled traffic)"] = ceiling(Router.load(base), shipped[1], args, cache, rows,
                                                                  examples, held)
    decisions = {}
    for n in sorted(args.sizes):
        variant = "".join(c if c.isalnum() or c in ".-" else "_" for c in args.adapt_args.strip())
        variant += f"_features-{args.features}" if args.features else ""
        out = cache / (f"adapted_{n}" + (f"_{variant}" if variant else ""))
        extra = args.adapt_args.split()
        if args.features:  # an untrained template: always installed (its gate is logged), the scorer not refit
            extra += ["--cascade", "none", "--min-gain", "-1"]
        a = adapt_parser().parse_args(extra + [
            "--data", str(paths["traffic"]), "--limit", str(n), "--router", base, "--out", str(out),
            "--small", args.small, "--large", args.large, "--stop", "\n", "--max-tokens", str(ANSWER_BUDGET),
            "--label-cache", str(cache / "pairs.jsonl"), "--log", str(cache / "adapt_log.jsonl"),
            "--prompt-stats-cache", str(shift_data.CACHE_ROOT / "prompt_stats.jsonl")])
        t0 = time.perf_counter()
        summary = adapt_run(a)
        seconds = time.perf_counter() - t0
        decisions[n] = [{k: d.get(k) for k in ("kind", "decision", "validation", "current", "new")}
                        for d in summary["decisions"]]
        swapped = {d["kind"]: d["decision"] == "swapped" for d in summary["decisions"]}
        r = Router.load(out) if swapped.get("router") else shipped[0]
        c = Router.load(out / "cascade") if swapped.get("escalation") else shipped[1]
        results["adapted"][n] = score(r, c, {"swapped": swapped, "adapt_seconds": round(seconds, 1)})
    print(f"\n{'policy':<28} {'router APGR':>11} {'95% CI':>15} {'cascade APGR':>12} {'95% CI':>15} "
          f"{'large (static)':>14} {'large (held)':>12}")
    table = [("shipped", results["shipped"])] + [(f"adapted on {n} prompts", v)
                                                 for n, v in results["adapted"].items()]
    if args.ceiling:
        table.append(("refit on traffic references", results["ceiling (reference-labelled traffic)"]))
    for name, v in table:
        rr, cc = v["router"], v["cascade (learned)"]
        print(f"{name:<28} {rr['apgr']:11.3f} [{rr['apgr_ci'][0]:5.3f}, {rr['apgr_ci'][1]:5.3f}] "
              f"{cc['apgr']:12.3f} [{cc['apgr_ci'][0]:5.3f}, {cc['apgr_ci'][1]:5.3f}] "
              f"{rr['static_large_fraction']:14.1%} {rr['held_large_fraction']:12.1%}")
    best = results["adapted"][max(args.sizes)]
    checks = {
        f"adapted router APGR >= 0.70 (EM, {max(args.sizes)} prompts)": best["router"]["apgr"] >= 0.70,
        "adapted learned cascade APGR >= adapted router APGR": best["cascade (learned)"]["apgr"] >=
        best["router"]["apgr"],
        "held large fraction within 3 points of 30%": abs(best["router"]["held_large_fraction"] - TARGET) <= 0.03,
        "adapted static threshold within 3 points of 30%": abs(best["router"]["static_large_fraction"] - TARGET)
        <= 0.03,
    }
    print()
    for k, ok in checks.items():
        print(f"{'met' if ok else 'NOT met'}: {k}")
    write_results(Path(args.out), {"family": key, "adapt_args": args.adapt_args, "eval_prompts": len(rows),
                                   "eval_modules": len({r["group"] for r in rows}),
                                   "eval_exact": {"small": small, "large": large}, "bootstrap": args.bootstrap,
                                   "target_large_fraction": TARGET, "results": results, "decisions": decisions,
                                   "checks": checks, "load_average": [round(x, 2) for x in os.getloadavg()]},
                  indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
