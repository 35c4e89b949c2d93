"""Quality vs cost of routing policies on the held-out prompts of the default models.

Quality of a prompt = teacher-forced mean log-probability of its true continuation under the model that
answers it (from `tandem router label`); relative quality = exp(q - q_large) = perplexity_large /
perplexity_policy. Cost = large-model tokens (prompt + continuation of every prompt the large model serves)
over always-large's. Policies: always-small, always-large, the router at 3 thresholds (target large
fractions), the oracle (for context). The cascade half of this bench adds its points through `Point` too.
Prints a table, writes bench/results/routing.json and bench/results/routing.png.

    .venv/bin/python bench/routing.py [--router models/router] [--data models/router/labels/test.jsonl]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from router_model.data import parse_example  # noqa: E402
from router_model.router import Router  # noqa: E402

ROUTER_FRACTIONS = (0.2, 0.3, 0.5)


@dataclass
class Point:
    policy: str
    quality: float  # mean score (mean continuation log-prob)
    relative_quality: float  # exp(quality - always-large quality)
    cost: float  # large-model tokens / always-large's
    large_fraction: float  # share of prompts answered by the large model
    pgr: float  # (quality - small) / (large - small)


@dataclass
class Prompts:
    small: np.ndarray
    large: np.ndarray
    tokens: np.ndarray  # tokens the large model processes when it serves the prompt
    rows: list[dict]

    def point(self, policy: str, to_large: np.ndarray) -> Point:
        q = float(np.where(to_large, self.large, self.small).mean())
        q_small, q_large = float(self.small.mean()), float(self.large.mean())
        return Point(policy=policy, quality=q, relative_quality=math.exp(q - q_large),
                     cost=float(self.tokens[to_large].sum() / self.tokens.sum()),
                     large_fraction=float(np.mean(to_large)), pgr=(q - q_small) / (q_large - q_small))


def load_prompts(path: Path, continuation: int) -> Prompts:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for i, r in enumerate(rows):
        parse_example(r, f"{path}:{i + 1}")  # same validation as the router CLI
    tokens = np.array([r.get("prompt_tokens", max(1, len(r.get("prompt", "")) // 4)) + continuation for r in rows])
    return Prompts(small=np.array([r["small_score"] for r in rows]), large=np.array([r["large_score"] for r in rows]),
                   tokens=tokens.astype(np.float64), rows=rows)


def baseline_points(p: Prompts) -> list[Point]:
    n = p.small.size
    return [p.point("always-small", np.zeros(n, bool)), p.point("always-large", np.ones(n, bool)),
            p.point("oracle (50% large)", _top(p.large - p.small, 0.5))]


def router_points(p: Prompts, router: Router) -> list[Point]:
    scores = np.array([router.score(r.get("messages") or r["prompt"], r.get("extras")) for r in p.rows])
    points = []
    for f in ROUTER_FRACTIONS:
        threshold = router.threshold_for_fraction(f)
        points.append(p.point(f"router t={threshold:.4f} ({f:.0%})", scores >= threshold))
    return points


def _top(values: np.ndarray, fraction: float) -> np.ndarray:
    out = np.zeros(values.size, bool)
    out[np.argsort(-values, kind="stable")[:int(round(fraction * values.size))]] = True
    return out


def plot(points: list[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for pt in points:
        marker = "s" if pt.policy.startswith("always") else "^" if pt.policy.startswith("oracle") else "o"
        ax.scatter(pt.cost * 100, pt.relative_quality * 100, marker=marker)
        ax.annotate(pt.policy, (pt.cost * 100, pt.relative_quality * 100), fontsize=7,
                    textcoords="offset points", xytext=(4, 4))
    ax.axhline(95, ls="--", lw=0.8, color="grey")
    ax.axvline(50, ls="--", lw=0.8, color="grey")
    ax.set_xlabel("cost: large-model tokens (% of always-large)")
    ax.set_ylabel("quality: perplexity ratio to always-large (%)")
    ax.set_title("tandem routing on held-out prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--router", default=str(ROOT / "models/router"))
    ap.add_argument("--data", default=str(ROOT / "models/router/labels/test.jsonl"))
    ap.add_argument("--continuation", type=int, default=32, help="continuation tokens scored per prompt")
    ap.add_argument("--out", default=str(ROOT / "bench/results/routing.json"))
    args = ap.parse_args(argv)

    prompts = load_prompts(Path(args.data), args.continuation)
    points = baseline_points(prompts) + router_points(prompts, Router.load(args.router))

    print(f"{len(prompts.rows)} held-out prompts from {args.data}; router {args.router}")
    print(f"{'policy':<26} {'quality':>9} {'rel. quality':>13} {'cost':>7} {'% large':>8} {'PGR':>7}")
    for pt in points:
        print(f"{pt.policy:<26} {pt.quality:9.4f} {pt.relative_quality:12.1%} {pt.cost:7.1%} "
              f"{pt.large_fraction:8.1%} {pt.pgr:7.3f}")
    hits = [pt.policy for pt in points if pt.relative_quality >= 0.95 and pt.cost <= 0.5
            and not pt.policy.startswith("oracle")]
    print(f"target (>= 95% of always-large quality at <= 50% of its cost): {', '.join(hits) or 'not reached'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"data": args.data, "router": args.router, "points": [asdict(p) for p in points],
                               "target_reached_by": hits}, indent=2) + "\n")
    plot(points, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
