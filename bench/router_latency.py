"""Router decision latency: featurise + score + threshold per prompt, p50/p99/max, on real prompt shapes.

Uses the shipped router (models/router) and its held-out test prompts when present, else a router trained on
the synthetic set. Prints a table and writes bench/results/router_latency.json. Target: p99 <= 1 ms.

    .venv/bin/python bench/router_latency.py [--router models/router] [--data models/router/labels/test.jsonl]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from router_model.data import parse_example, read_examples  # noqa: E402
from router_model.router import Router  # noqa: E402
from router_model.synthetic import synthetic_rows  # noqa: E402
from router_model.train import TrainOptions, train_router  # noqa: E402

CHAT = [{"role": "system", "content": "You are a careful assistant. Answer in one paragraph."},
        {"role": "user", "content": "Explain what a context manager is in Python."},
        {"role": "assistant", "content": "A context manager wraps setup and teardown around a block: " * 4},
        {"role": "user", "content": "Now show one that times a block of code and prints the elapsed seconds."}]


def _percentiles(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples) * 1e6
    return {"p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99)),
            "max_us": float(a.max()), "n": int(a.size)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--router", default=str(ROOT / "models/router"))
    p.add_argument("--data", default=str(ROOT / "models/router/labels/test.jsonl"))
    p.add_argument("--repeat", type=int, default=3, help="passes over the prompts")
    p.add_argument("--out", default=str(ROOT / "bench/results/router_latency.json"))
    args = p.parse_args(argv)

    if (Path(args.router) / "router.json").exists():
        router, source = Router.load(args.router), args.router
    else:
        rows = [parse_example(r, "synthetic") for r in synthetic_rows(400)]
        router, source = train_router(rows, TrainOptions(c_grid=(1.0,), folds=3), log=lambda *_: None), "synthetic"
    examples = read_examples(args.data) if Path(args.data).exists() else \
        [parse_example(r, "synthetic") for r in synthetic_rows(500, seed=1)]
    extras = {name: -2.0 for name in router.required_extras}  # the gateway fills these from the prefill
    prompts = [ex.conversation for ex in examples]
    sets = {"held-out prompts" if Path(args.data).exists() else "synthetic prompts": prompts,
            "4-turn chat": [CHAT] * 300,
            "8k-char prompt": ["x = compute(a, b)  # step\n" * 320] * 100}

    results = {}
    for name, items in sets.items():
        for x in items[:20]:  # warm-up: first-call allocations and the word-hash memo
            router.decide(x, extras=extras)
        feat_t, decide_t = [], []
        for _ in range(args.repeat):
            for x in items:
                t0 = time.perf_counter()
                router.features(x, extras)
                t1 = time.perf_counter()
                router.decide(x, extras=extras)
                t2 = time.perf_counter()
                feat_t.append(t1 - t0)
                decide_t.append(t2 - t1)
        chars = float(np.mean([len(x) if isinstance(x, str) else sum(len(m["content"]) for m in x) for x in items]))
        results[name] = {"mean_chars": chars, "featurize": _percentiles(feat_t), "decide": _percentiles(decide_t)}

    print(f"router: {source}  ({platform.processor() or platform.machine()}, numpy {np.__version__})")
    print(f"{'prompt set':<20} {'chars':>7} {'feat p50':>9} {'feat p99':>9} {'decide p50':>11} {'decide p99':>11}"
          f" {'decide max':>11}")
    for name, r in results.items():
        f, d = r["featurize"], r["decide"]
        print(f"{name:<20} {r['mean_chars']:7.0f} {f['p50_us']:8.0f}u {f['p99_us']:8.0f}u {d['p50_us']:10.0f}u "
              f"{d['p99_us']:10.0f}u {d['max_us']:10.0f}u")
    ok = all(r["decide"]["p99_us"] <= 1000 for r in results.values())
    print(f"target decide p99 <= 1000 us: {'met' if ok else 'NOT met'} (the 8k-char set is the worst case)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"router": source, "results": results, "target_met": ok}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
