"""Routers that read the small model's prefill of the prompt (router_model/prompt_stats.py), trained from scratch
on the shipped labels (the stdlib's training modules, `models/router/labels/train.jsonl.gz`) as the shipped
router was (5 grouped folds, C from 1/3/10, Platt), and scored with 95% bootstrap intervals over modules on the
original held-out split (`test.jsonl.gz`) and on a shifted set's evaluation modules (bench/routing_shift_data.py;
never adapted on here). What adaptation on the shifted traffic adds: `bench/routing_shift.py --features prompt-lp`.

    .venv/bin/python bench/routing_prompt_stats.py [--family werkzeug,anyio,pydantic,packaging,jinja2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import bench.routing_shift_data as shift_data  # noqa: E402
from bench.results_meta import write_results  # noqa: E402
from bench.routing_shift import evaluate  # noqa: E402
from router_model.data import parse_example, read_rows  # noqa: E402
from router_model.features import DEFAULT_BLOCKS, STAT_NAMES, FeatureConfig  # noqa: E402
from router_model.prompt_stats import PROMPT_EXTRAS, PromptStats  # noqa: E402
from router_model.router import Router  # noqa: E402
from router_model.train import TrainOptions, train_router  # noqa: E402

VARIANTS = {"text + prefill": FeatureConfig(blocks=DEFAULT_BLOCKS, stats=STAT_NAMES, extras=tuple(PROMPT_EXTRAS)),
            "stats + prefill": FeatureConfig(blocks=(), stats=STAT_NAMES, extras=tuple(PROMPT_EXTRAS))}


def with_stats(rows: list[dict], stats: PromptStats, where: str) -> list:
    examples = [parse_example(r, f"{where}:{i}") for i, r in enumerate(rows, 1)]
    for ex, st in zip(examples, stats([ex.conversation for ex in examples])):
        ex.extras |= st
    return examples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--router", default=str(ROOT / "models/router"))
    ap.add_argument("--small", default=str(ROOT / "models/tandem-tiny-s"))
    ap.add_argument("--family", default="werkzeug,anyio,pydantic,packaging,jinja2")
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--out", default=str(ROOT / "bench/results/routing_prompt_stats.json"))
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    shipped = (Router.load(args.router), Router.load(Path(args.router) / "cascade"))
    stats = PromptStats(args.small, shift_data.CACHE_ROOT / "prompt_stats.jsonl")
    labels = Path(args.router) / "labels"
    train_rows = read_rows(labels / "train.jsonl.gz")
    train = with_stats(train_rows, stats, "train")
    sets = {"stdlib held-out": read_rows(labels / "test.jsonl.gz"),
            shift_data.family_key(args.family): shift_data.read_jsonl(
                shift_data.ensure(Path(args.small), ROOT / "models/tandem-tiny-l", family=args.family)["eval"])}
    sets = {name: (rows, with_stats(rows, stats, name)) for name, rows in sets.items()}
    routers = {"shipped (text only)": shipped[0]}
    fit_seconds = {}
    for name, cfg in VARIANTS.items():
        t0 = time.perf_counter()
        opts = TrainOptions(feature_config=cfg, c_grid=(1.0, 3.0, 10.0), folds=5, target_large_fraction=0.3)
        routers[name] = train_router(train, opts, log=lambda *a: None)
        fit_seconds[name] = round(time.perf_counter() - t0, 1)
    results = {name: {s: evaluate(r, shipped[1], rows, ex, args.bootstrap)["router"] for s, (rows, ex) in
                      sets.items()} | {"C": r.metadata.get("C"), "cv_apgr": r.metadata.get("cv_apgr_calibrated")}
               for name, r in routers.items()}
    print(f"{'router (trained on the stdlib train split)':<44}" + "".join(f"{s[:28]:>32}" for s in sets))
    for name, res in results.items():
        print(f"{name:<44}" + "".join(f"{res[s]['apgr']:>12.3f} [{res[s]['apgr_ci'][0]:.3f}, "
                                      f"{res[s]['apgr_ci'][1]:.3f}]" for s in sets))
    write_results(Path(args.out), {"family": shift_data.family_key(args.family), "bootstrap": args.bootstrap,
                                   "train_rows": len(train_rows), "prompt_extras": list(PROMPT_EXTRAS),
                                   "fit_seconds": fit_seconds, "results": results,
                                   "load_average": [round(x, 2) for x in os.getloadavg()]}, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
