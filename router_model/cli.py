"""`tandem router train | eval | label | adapt`: build, calibrate and evaluate the prompt router (and the cascade's
escalation scorer) from JSONL data; label prompts by task success; adapt both to unlabelled traffic."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from router_model.data import DataError, parse_example, read_rows
from router_model.evaluate import compare_policies, evaluate_scores, format_comparison, format_report
from router_model.features import KNOWN_EXTRAS, FeatureConfig
from router_model.router import NUM_QUANTILES, Router, RouterArtifactError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem router", description="Train, calibrate and evaluate the prompt router.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a router (or a cascade escalation scorer) from labelled JSONL")
    t.add_argument("--data", required=True, help="JSONL: prompt|messages and small_score+large_score or label")
    t.add_argument("--out", required=True, help="folder to write router.json + router.npz into")
    t.add_argument("--kind", choices=("router", "escalation"), default="router",
                   help="escalation: the cascade's scorer, which also reads each row's small_answer and "
                        "small_answer_stats (default: router, prompt only)")
    m = t.add_mutually_exclusive_group()
    m.add_argument("--margin", type=float, default=0.0,
                   help="large is needed when large_score - small_score > MARGIN (default 0)")
    m.add_argument("--margin-quantile", type=float, default=None,
                   help="use this quantile of the score gains as the margin instead (e.g. 0.5)")
    t.add_argument("--weighting", choices=("gain", "none"), default="none",
                   help="weight examples by |gain - margin| or equally (default)")
    t.add_argument("--class-weight", choices=("balanced",), default=None)
    t.add_argument("--calibration", choices=("sigmoid", "isotonic"), default="sigmoid")
    t.add_argument("--C", type=float, nargs="+", default=None, help="regularisation grid (default 0.1..3)")
    t.add_argument("--folds", type=int, default=5)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--target-large-fraction", type=float, default=0.3,
                   help="fraction of traffic to send large (or escalate); the threshold is that score quantile")
    t.add_argument("--hash-bits", type=int, default=None,
                   help="2**BITS buckets per n-gram block instead of the defaults (2**16-2**17); smaller is faster")
    t.add_argument("--extras", nargs="*", default=None, choices=sorted(KNOWN_EXTRAS),
                   help="extra per-request features read from each line's 'extras' (the caller must fill them)")

    e = sub.add_parser("eval", help="quality vs cost of the router (and cascade) against random, always-small, "
                                    "always-large and the oracle, with bootstrap intervals")
    e.add_argument("--data", required=True)
    e.add_argument("--router", required=True, help="router folder (router.json + router.npz)")
    e.add_argument("--cascade", default=None, help="escalation scorer folder: also evaluate the learned cascade "
                                                   "(and the raw-confidence cascade where rows have answer stats)")
    e.add_argument("--metric", nargs="+", default=None,
                   help="quality columns to report (rows' small_<m>/large_<m>; default: exact and edit where "
                        "present, else the rows' scores)")
    e.add_argument("--bootstrap", type=int, default=500, help="bootstrap resamples (by group) for the intervals")
    e.add_argument("--target-large-fraction", type=float, default=None,
                   help="set the artifact's threshold to the score quantile sending this fraction large and save it")
    e.add_argument("--cascade-target-fraction", type=float, default=None,
                   help="the same for the escalation scorer (the fraction of prompts escalated)")
    e.add_argument("--json", default=None, help="also write the metrics to this JSON file")

    sub.add_parser("adapt", help="self-label unlabelled traffic with both engines (and the gateway's shadow "
                                 "labels), refit router and scorer, keep each only if better on held-back "
                                 "traffic (see --help)", add_help=False)
    sub.add_parser("label", help="label prompts by task success: the default models on the held-out corpus, or "
                                 "your own pair and prompts with --data (see --help of each)", add_help=False)
    return p


def main(argv: list[str]) -> int:
    if argv[:1] == ["adapt"]:
        from router_model.adapt_cli import main as adapt_main  # imports the engines only when answering

        return adapt_main(argv[1:])
    if argv[:1] == ["label"]:
        if "--data" in argv or any(a.startswith("--data=") for a in argv):
            from router_model.user_labels import main as label_main
        else:
            from router_model.labels import main as label_main  # imports torch + engines only here
        return label_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        return _eval(args)
    except (DataError, RouterArtifactError, ValueError) as e:
        print(f"tandem router {args.command}: error: {e}", file=sys.stderr)
        return 2


def _train(args: argparse.Namespace) -> int:
    from router_model.train import ESCALATION_FEATURES, TrainOptions, train_router

    rows = read_rows(args.data)
    examples = [parse_example(r, f"{args.data}:{i}") for i, r in enumerate(rows, 1)]
    if args.kind == "escalation":
        fcfg = ESCALATION_FEATURES if args.extras is None else FeatureConfig(
            blocks=ESCALATION_FEATURES.blocks, extras=tuple(args.extras))
    else:
        fcfg = FeatureConfig(extras=tuple(args.extras or ()))
    if args.hash_bits is not None:
        if not 1 <= args.hash_bits <= 24:
            raise ValueError(f"--hash-bits must be in 1..24, got {args.hash_bits}")
        fcfg = dataclasses.replace(fcfg, blocks=tuple(dataclasses.replace(b, buckets=1 << args.hash_bits)
                                                      for b in fcfg.blocks))
    opts = TrainOptions(feature_config=fcfg, margin=args.margin, margin_quantile=args.margin_quantile,
                        weighting=args.weighting, calibration=args.calibration, folds=args.folds, seed=args.seed,
                        target_large_fraction=args.target_large_fraction, class_weight=args.class_weight,
                        kind=args.kind)
    if args.C:
        opts.c_grid = tuple(args.C)
    router = train_router(examples, opts)
    router.metadata["data"] = str(args.data)
    out = router.save(args.out)
    print(f"saved {args.kind} to {out}")
    return 0


def _metrics_of(rows: list[dict], examples, wanted: list[str] | None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    names = wanted or [m for m in ("exact", "edit") if all(f"small_{m}" in r and f"large_{m}" in r for r in rows)]
    out = {}
    for m in names:
        if m == "score":
            q = np.array([ex.qualities() for ex in examples])
            out[m] = (q[:, 0], q[:, 1])
            continue
        missing = [i for i, r in enumerate(rows, 1) if f"small_{m}" not in r or f"large_{m}" not in r]
        if missing:
            raise DataError(f"metric {m!r}: line {missing[0]} has no small_{m}/large_{m}")
        out[m] = (np.array([float(r[f"small_{m}"]) for r in rows]), np.array([float(r[f"large_{m}"]) for r in rows]))
    if not out:
        q = np.array([ex.qualities() for ex in examples])
        out["score"] = (q[:, 0], q[:, 1])
    return out


def policy_scores(rows: list[dict], examples, router: Router, cascade: Router | None) -> dict[str, np.ndarray]:
    """Higher = sent (escalated) to large first: the router, the learned cascade, the raw-confidence cascades."""
    from router_model.features import Featurizer

    def batch(r: Router) -> np.ndarray:
        dense, hashed = Featurizer(r.feature_config).transform(
            [ex.conversation for ex in examples], [ex.extras for ex in examples], [ex.answer for ex in examples])
        return r.score_many(dense, hashed)

    out = {"router": batch(router)}
    if cascade is not None:
        if not cascade.needs_answer:
            raise DataError(f"--cascade artifact is a {cascade.kind} that does not read the small answer")
        if any(ex.answer is None for ex in examples):
            raise DataError("--cascade needs each row's small_answer (and small_answer_stats)")
        out["cascade (learned)"] = batch(cascade)
    if all("answer_mean_logprob" in ex.extras for ex in examples):
        out["cascade (mean logprob)"] = -np.array([ex.extras["answer_mean_logprob"] for ex in examples])
        out["cascade (min logprob)"] = -np.array([ex.extras["answer_min_logprob"] for ex in examples])
    return out


def _set_threshold(r: Router, scores: np.ndarray, f: float, folder: str) -> None:
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"target fraction must be in [0, 1], got {f}")
    k = int(round(f * scores.size))
    # the k-th highest score: exactly k prompts (barring ties) reach it
    r.threshold = float(np.sort(scores)[::-1][k - 1]) if k > 0 else r.threshold_for_fraction(0.0)
    r.target_large_fraction = f
    r.score_quantiles = np.quantile(scores, np.linspace(0.0, 1.0, NUM_QUANTILES))
    r.save_threshold(folder)
    print(f"saved threshold {r.threshold:.4f} (sends {np.mean(scores >= r.threshold):.1%} large here) to "
          f"{Path(folder) / 'router.json'}")


def _eval(args: argparse.Namespace) -> int:
    router = Router.load(args.router)
    cascade = Router.load(args.cascade) if args.cascade else None
    rows = read_rows(args.data)
    examples = [parse_example(r, f"{args.data}:{i}") for i, r in enumerate(rows, 1)]
    policies = policy_scores(rows, examples, router, cascade)
    metrics = _metrics_of(rows, examples, args.metric)
    skipped = [m for m, (small, large) in metrics.items() if small.mean() == large.mean()]
    for m in skipped:
        print(f"quality = {m}: both models have the same mean ({metrics[m][0].mean():.4f}) on this data, so PGR is "
              f"undefined; not reported")
    metrics = {m: v for m, v in metrics.items() if m not in skipped}
    if not metrics:
        raise DataError(f"{args.data}: the two models score the same on average under every metric: nothing to "
                        f"route on")
    groups = [ex.group for ex in examples] if all(ex.group is not None for ex in examples) else None
    first = next(iter(metrics))
    ev = evaluate_scores(policies["router"], *metrics[first])
    print(f"router {args.router} on {args.data} (quality = {first})")
    print(format_report(ev))
    comparison = {}
    for name, (small, large) in metrics.items():
        curves = compare_policies(policies, small, large, groups, bootstrap=args.bootstrap)
        comparison[name] = {k: v.to_dict() for k, v in curves.items()}
        print(f"\n{len(rows)} prompts, {args.bootstrap} bootstrap resamples"
              f"{' of groups' if groups else ''}; cost = share of prompts answered by (escalated to) large")
        print(format_comparison(curves, name, float(small.mean()), float(large.mean())))
    frac = float(np.mean(policies["router"] >= router.threshold))
    print(f"\nartifact threshold {router.threshold:.4f} sends {frac:.1%} of these prompts large "
          f"(target {router.target_large_fraction})")
    if args.target_large_fraction is not None:
        _set_threshold(router, policies["router"], args.target_large_fraction, args.router)
    if args.cascade_target_fraction is not None:
        if cascade is None:
            raise ValueError("--cascade-target-fraction needs --cascade")
        _set_threshold(cascade, policies["cascade (learned)"], args.cascade_target_fraction, args.cascade)
    if args.json:
        doc = ev.to_dict() | {"data": str(args.data), "router": str(args.router), "cascade": args.cascade,
                              "threshold": router.threshold, "target_large_fraction": router.target_large_fraction,
                              "primary_metric": first, "bootstrap": args.bootstrap, "comparison": comparison,
                              "skipped_metrics": skipped}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0
