"""`tandem router train | eval | label`: build, calibrate and evaluate the prompt router from JSONL data."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from router_model.data import DataError, read_examples
from router_model.evaluate import evaluate_scores, format_report
from router_model.features import KNOWN_EXTRAS, FeatureConfig
from router_model.router import NUM_QUANTILES, Router, RouterArtifactError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem router", description="Train, calibrate and evaluate the prompt router.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a router from labelled JSONL")
    t.add_argument("--data", required=True, help="JSONL: prompt|messages and small_score+large_score or label")
    t.add_argument("--out", required=True, help="folder to write router.json + router.npz into")
    m = t.add_mutually_exclusive_group()
    m.add_argument("--margin", type=float, default=0.0,
                   help="large is needed when large_score - small_score > MARGIN (default 0)")
    m.add_argument("--margin-quantile", type=float, default=None,
                   help="use this quantile of the score gains as the margin instead (e.g. 0.5)")
    t.add_argument("--weighting", choices=("gain", "none"), default="gain",
                   help="weight examples by |gain - margin| (default) or equally")
    t.add_argument("--calibration", choices=("sigmoid", "isotonic"), default="sigmoid")
    t.add_argument("--C", type=float, nargs="+", default=None, help="regularisation grid (default 0.03..3)")
    t.add_argument("--folds", type=int, default=5)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--target-large-fraction", type=float, default=0.3,
                   help="fraction of traffic to send large; the threshold is that score quantile (default 0.3)")
    t.add_argument("--extras", nargs="*", default=[], choices=sorted(KNOWN_EXTRAS),
                   help="extra per-request features read from each line's 'extras' (the gateway must fill them)")
    t.add_argument("--word-buckets", type=int, default=FeatureConfig.word_buckets)
    t.add_argument("--char-buckets", type=int, default=FeatureConfig.char_buckets)

    e = sub.add_parser("eval", help="PGR / APGR / CPT of a router on labelled JSONL (needs scores or labels)")
    e.add_argument("--data", required=True)
    e.add_argument("--router", required=True, help="router folder (router.json + router.npz)")
    e.add_argument("--target-large-fraction", type=float, default=None,
                   help="set the artifact's threshold to the score quantile sending this fraction large and save it")
    e.add_argument("--json", default=None, help="also write the metrics to this JSON file")

    lab = sub.add_parser("label", help="build labelled JSONL for the default models from the held-out corpus")
    lab.add_argument("rest", nargs=argparse.REMAINDER, help="options of router_model.labels (see --help)")
    return p


def main(argv: list[str]) -> int:
    if argv[:1] == ["label"]:
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
    from router_model.train import TrainOptions, train_router

    examples = read_examples(args.data)
    fcfg = FeatureConfig(word_buckets=args.word_buckets, char_buckets=args.char_buckets, extras=tuple(args.extras))
    opts = TrainOptions(feature_config=fcfg, margin=args.margin, margin_quantile=args.margin_quantile,
                        weighting=args.weighting, calibration=args.calibration, folds=args.folds, seed=args.seed,
                        target_large_fraction=args.target_large_fraction)
    if args.C:
        opts.c_grid = tuple(args.C)
    router = train_router(examples, opts)
    router.metadata["data"] = str(args.data)
    out = router.save(args.out)
    print(f"saved router to {out}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    router = Router.load(args.router)
    examples = read_examples(args.data)
    scores = np.array([router.score(ex.conversation, ex.extras) for ex in examples])
    q = np.array([ex.qualities() for ex in examples])
    ev = evaluate_scores(scores, q[:, 0], q[:, 1])
    print(f"router {args.router} on {args.data}")
    print(format_report(ev))
    frac = float(np.mean(scores >= router.threshold))
    print(f"\nartifact threshold {router.threshold:.4f} sends {frac:.1%} of these prompts large "
          f"(target {router.target_large_fraction})")
    if args.target_large_fraction is not None:
        f = args.target_large_fraction
        if not 0.0 <= f <= 1.0:
            raise ValueError(f"--target-large-fraction must be in [0, 1], got {f}")
        k = int(round(f * scores.size))
        # the k-th highest score: exactly k prompts (barring ties) reach it
        router.threshold = float(np.sort(scores)[::-1][k - 1]) if k > 0 else router.threshold_for_fraction(0.0)
        router.target_large_fraction = f
        router.score_quantiles = np.quantile(scores, np.linspace(0.0, 1.0, NUM_QUANTILES))
        router.save_threshold(args.router)
        print(f"saved threshold {router.threshold:.4f} (sends {np.mean(scores >= router.threshold):.1%} large "
              f"here) to {Path(args.router) / 'router.json'}")
    if args.json:
        doc = ev.to_dict() | {"data": str(args.data), "router": str(args.router), "threshold": router.threshold,
                              "target_large_fraction": router.target_large_fraction}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0
