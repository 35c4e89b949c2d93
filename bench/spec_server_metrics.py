"""What the speculative server does at a load where it does not draft: bench/spec_server.py's two servers (the
widened tandem-tiny-l alone, and with tandem-tiny-s drafting), one at a time in alternation, each driven by the
same closed loop of `--streams` streams for `--seconds` (after a warm-up), greedy; per run the client's tok/s
and TPOT p50/p99, and from the server's /metrics what it drafted, accepted and preempted and its prefix-cache
hits. Prints a line per run, writes bench/results/spec_server_metrics.json.

    .venv/bin/python bench/spec_server_metrics.py [--streams 32] [--pairs 2] [--seconds 25]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402
from bench.spec_server import closed_loop, start  # noqa: E402
from bench.speculative import SMALL, prompts_from_heldout  # noqa: E402
from engines.tokenizer import Tokenizer  # noqa: E402
from training.widen import DEFAULT_FACTOR, cached_wide  # noqa: E402

METRICS = ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total", "num_preemptions_total",
           "prefix_cache_queries_total", "prefix_cache_hits_total")


def engine_metrics(url: str) -> dict[str, float]:
    """The target engine's (model_name="tandem") counters of METRICS from the server's Prometheus page."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r'tandem:(\w+)\{model_name="tandem"\} (\S+)$', line)
        if m and m.group(1) in METRICS:
            out[m.group(1)] = float(m.group(2))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=2, help="plain / speculative runs, alternated")
    ap.add_argument("--seconds", type=float, default=25.0)
    ap.add_argument("--warmup-seconds", type=float, default=6.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "spec_server_metrics.json"))
    args = ap.parse_args(argv)
    folder = cached_wide(DEFAULT_FACTOR)
    prompts = prompts_from_heldout(Tokenizer.from_pretrained(folder), 48, args.prompt_tokens, seed=7)
    ctx = args.prompt_tokens + args.max_tokens + 16
    runs = []
    order = [name for pair in range(args.pairs) for name in (("plain", "spec"), ("spec", "plain"))[pair % 2]]
    for name in order:
        proc, url = start(folder, 1, ctx, folder.parent / f"metrics_{name}.log", SMALL if name == "spec" else None,
                          "w8a8", args.k)
        try:
            asyncio.run(closed_loop(url, prompts, args.streams, args.max_tokens, 0.0, args.warmup_seconds))
            before = engine_metrics(url)
            r = asyncio.run(closed_loop(url, prompts, args.streams, args.max_tokens, 0.0, args.seconds))
            after = engine_metrics(url)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        row = {"server": name, **{k: v for k, v in r.items() if not isinstance(v, list)},
               "during_run": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in METRICS},
               "whole_life": after}
        runs.append(row)
        d = row["during_run"]
        print(f"{name:5s} tok/s {r['tok_s']:.1f} TPOT p50 {r['tpot_p50_ms']:.1f} p99 {r['tpot_p99_ms']:.1f} ms; "
              f"in the run: drafted {d['spec_decode_num_draft_tokens_total']:.0f} (accepted "
              f"{d['spec_decode_num_accepted_tokens_total']:.0f}), preempted {d['num_preemptions_total']:.0f}, "
              f"prefix hits {d['prefix_cache_hits_total']:.0f} / {d['prefix_cache_queries_total']:.0f} tokens; "
              f"drafted over the server's life {after.get('spec_decode_num_draft_tokens_total', 0.0):.0f}",
              flush=True)
    write_results(Path(args.out), {"config": vars(args), "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
