"""`tandem router adapt --data PROMPTS.jsonl --router DIR --out DIR`: self-label unlabelled prompts (both engines,
greedy, batched, cached) and the gateway's stored shadow / cascade-verification labels, refit the router and the
escalation scorer with the shipped data as a prior, and write each only where it validates better on held-back
traffic (router_model.adapt). The router goes to OUT, the escalation scorer to OUT/cascade; decisions are
appended to OUT/adapt_log.jsonl (or --log).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from router_model.adapt import AdaptOptions, Traffic, artifact_version, decide, holdout_split, refit
from router_model.data import DataError, read_rows
from router_model.prompt_stats import needs_prompt_stats
from router_model.router import Router, RouterArtifactError
from router_model.self_labels import LabelModel, answer_pairs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem router adapt", description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="unlabelled prompts: JSONL lines with 'prompt' or 'messages' "
                                                "(optional 'group': a source, a customer; never split)")
    p.add_argument("--shadow-labels", nargs="*", default=[], help="the gateway's shadow label files "
                   "(router.shadow_labels; rows without prompt text refit the router from their stored features)")
    p.add_argument("--verification-labels", nargs="*", default=[],
                   help="the gateway's cascade verification files (cascade.verification_labels)")
    p.add_argument("--router", required=True, help="the current router folder")
    p.add_argument("--cascade", default=None, help="the current escalation scorer (default: ROUTER/cascade if "
                                                   "there; 'none' skips it)")
    p.add_argument("--out", required=True, help="where a better router goes (a better scorer: OUT/cascade)")
    p.add_argument("--small", default="models/tandem-tiny-s")
    p.add_argument("--large", default="models/tandem-tiny-l")
    p.add_argument("--max-tokens", type=int, default=32, help="each answer's budget (the shadow runs' default)")
    p.add_argument("--stop", nargs="*", default=[], help="stop strings (e.g. '\\n' for line completion)")
    p.add_argument("--batch", type=int, default=256, help="prompts per generate call")
    p.add_argument("--label-cache", default=None, help="JSONL of answered pairs, reused across runs")
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts of --data")
    p.add_argument("--prior-data", default=None, help="the shipped reference-labelled rows (default: the "
                                                      "artifact's metadata 'data')")
    p.add_argument("--label", choices=("model", "disagreement"), default="model",
                   help="what a pair's label is: the label model's P(large right, small wrong), or 1 - the "
                        "answers' edit similarity (a regression on agreement similarity)")
    p.add_argument("--prior-share", type=float, default=0.3, help="their share of the training weight")
    p.add_argument("--prior-max", type=int, default=3000)
    p.add_argument("--holdout", type=float, default=0.25, help="share of traffic groups held back to validate")
    p.add_argument("--min-gain", type=float, default=0.0, help="swap only above the current APGR + this")
    p.add_argument("--folds", type=int, default=3)
    p.add_argument("--C", type=float, default=None, help="regularisation (default: the artifact's own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default=None, help="decision log (default OUT/adapt_log.jsonl)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads for the engines (0: default)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt-stats-cache", default=None, help="JSONL cache of the small model's prompt statistics "
                   "(only for a router whose extras read them: router_model/prompt_stats.py)")
    return p


def _prompt(row: dict, where: str) -> Any:
    if isinstance(row.get("prompt"), str):
        return row["prompt"]
    if isinstance(row.get("messages"), list) and row["messages"]:
        return row["messages"]
    raise DataError(f"{where}: needs a 'prompt' string or a 'messages' list")


def _records(paths: list[str]) -> list[dict]:
    out = []
    for path in paths:
        for p in (Path(path + ".1"), Path(path)):  # the rotated older file first
            if p.is_file():
                out += read_rows(p)
    return out


class DisagreementLabel:
    """`--label disagreement`: a pair's label is 1 - the edit similarity of its two answers, no label model."""

    def label(self, pair: dict) -> float:
        return 1.0 - float(pair["agreement"]["edit_similarity"])


def gather(args: argparse.Namespace, label_model: LabelModel, want_scorer: bool, log=print
           ) -> tuple[Traffic, Traffic, dict]:
    """(router traffic, escalation traffic, counts) from --data, --shadow-labels and --verification-labels."""
    if getattr(args, "label", "model") == "disagreement":
        label_model = DisagreementLabel()
    router_t, scorer_t = Traffic(), Traffic()
    counts = {"prompts": 0, "shadow": 0, "shadow_features_only": 0, "verifications": 0, "engine_runs": 0}
    if args.data:
        rows = read_rows(args.data)
        if args.limit:
            rows = rows[:args.limit]
        prompts = [_prompt(r, f"{args.data}:{i}") for i, r in enumerate(rows, 1)]
        opts = {"dtype": args.dtype}
        pairs = answer_pairs(prompts, args.small, args.large, max_tokens=args.max_tokens, stop=args.stop,
                             batch=args.batch, cache=args.label_cache, log=log, **opts)
        for i, (row, conv, pair) in enumerate(zip(rows, prompts, pairs)):
            q = label_model.label(pair)
            group = row.get("group", f"prompt:{i}")
            router_t.add(conv, q, group)
            scorer_t.add(conv, q, group, pair["small_answer"], pair["small_answer_stats"])
        counts["prompts"] = len(rows)
    for i, rec in enumerate(_records(args.shadow_labels)):
        if "agreement" not in rec and "first_line_exact" in rec:
            rec = rec | {"agreement": {k: rec[k] for k in ("first_line_exact", "exact", "edit_similarity")}}
        q = label_model.label(rec)
        conv = rec.get("prompt", rec.get("messages"))
        router_t.add(conv, q, f"shadow:{i}", features=None if conv is not None else rec.get("features"))
        if conv is not None and rec.get("small_answer") is not None and want_scorer:
            scorer_t.add(conv, q, f"shadow:{i}", rec["small_answer"], rec.get("small_answer_stats"))
        counts["shadow"] += 1
        counts["shadow_features_only"] += conv is None
    for i, rec in enumerate(_records(args.verification_labels)):
        if want_scorer:
            scorer_t.add(None, label_model.label(rec), f"verification:{i}", features=rec.get("features"))
        counts["verifications"] += 1
    return router_t, scorer_t, counts


def add_prompt_stats(current: Router, prior_rows: list[dict], traffic: Traffic, opts: AdaptOptions,
                     args: argparse.Namespace, log=print) -> list[dict]:
    """For a router that reads the small model's prefill: those statistics of each traffic prompt (as its
    extras) and of the prior rows the refit uses (subsampled here as `refit` would: only those are scored)."""
    from router_model.prompt_stats import PromptStats

    if len(prior_rows) > opts.prior_max:
        keep = np.linspace(0, len(prior_rows) - 1, opts.prior_max).round().astype(int)
        prior_rows = [prior_rows[i] for i in keep]
    stats = PromptStats(args.small, getattr(args, "prompt_stats_cache", None), dtype=args.dtype)
    idx = [i for i, c in enumerate(traffic.conversations) if c is not None]
    log(f"small-model prompt statistics for {len(idx)} traffic prompts and {len(prior_rows)} prior rows")
    for i, s in zip(idx, stats([traffic.conversations[i] for i in idx], log)):
        traffic.stats[i] = (traffic.stats[i] or {}) | s
    prompts = [_prompt(r, f"prior:{i}") for i, r in enumerate(prior_rows, 1)]
    return [r | {"extras": (r.get("extras") or {}) | s} for r, s in zip(prior_rows, stats(prompts, log))]


def run(args: argparse.Namespace, log=print) -> dict:
    router_dir = Path(args.router)
    current = Router.load(router_dir)
    cascade_dir = None if args.cascade == "none" else Path(args.cascade) if args.cascade else (
        router_dir / "cascade" if (router_dir / "cascade" / "router.json").is_file() else None)
    scorer = Router.load(cascade_dir) if cascade_dir else None
    prior_path = args.prior_data or current.metadata.get("data")
    if not prior_path or not Path(prior_path).is_file():
        raise DataError(f"the prior data {prior_path!r} (the artifact's training rows) is not there; give "
                        f"--prior-data FILE (reference-labelled rows with both answers)")
    prior_rows = read_rows(prior_path)
    label_model = LabelModel.fit(prior_rows)
    log(f"label model on {label_model.fitted_on} disagreeing prior pairs ({label_model.positive_rate:.1%} of them "
        f"large-only right)")
    router_t, scorer_t, counts = gather(args, label_model, scorer is not None, log)
    if len(router_t) < 20:
        raise DataError(f"{len(router_t)} self-labelled prompts are too few to adapt on (20 at least)")
    opts = AdaptOptions(holdout=args.holdout, prior_share=args.prior_share, prior_max=args.prior_max,
                        min_gain=args.min_gain, folds=args.folds, seed=args.seed, C=args.C)
    router_prior = prior_rows
    if needs_prompt_stats(current.feature_config.extras):
        router_prior = add_prompt_stats(current, prior_rows, router_t, opts, args, log)
    out = Path(args.out)
    log_path = args.log or str(out / "adapt_log.jsonl")
    extra = {"traffic": counts, "data": args.data, "prior_data": str(prior_path)}
    summary: dict[str, Any] = {"counts": counts, "decisions": []}
    for cur, cur_dir, traffic, dest, prior in ((current, router_dir, router_t, out, router_prior),
                                               (scorer, cascade_dir, scorer_t, out / "cascade", prior_rows)):
        if cur is None or len(traffic) < 20:
            continue
        fit_idx, val_idx = holdout_split(traffic.groups, opts.holdout, opts.seed)
        new = refit(cur, prior, traffic.subset(fit_idx), opts, log)
        rec = decide(cur, cur_dir, new, traffic.subset(val_idx), dest, opts, log_path, log, label_model,
                     extra | {"fit_rows": len(fit_idx)})
        summary["decisions"].append(rec)
    return summary


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    args.stop = [s.encode().decode("unicode_escape") for s in args.stop]
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        summary = run(args)
    except (DataError, RouterArtifactError, OSError, ValueError) as e:
        print(f"tandem router adapt: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"decisions": [{k: d.get(k) for k in ("kind", "decision", "current", "new", "validation")}
                                    for d in summary["decisions"]]}, indent=1))
    return 0


__all__ = ["artifact_version", "main", "parser", "run"]
