"""`tandem loadtest`: replay a workload mix or a real trace against any OpenAI-compatible endpoint and write
a report (JSON, Markdown, plots). A pure HTTP client: it imports nothing of the gateway or engines, nor torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from traces.workloads import workload_names

EPILOG = """examples (with `tandem serve` running: the embedded default, routes fast, best, auto, cascade):
  tandem loadtest --url http://127.0.0.1:8000 --workload chat --rate 2 --duration 5 \\
      --tokenizer models/tandem-tiny-s --model fast --slo fast:ttft=500,tpot=50 --out runs/chat
  tandem loadtest --url http://127.0.0.1:8000 --trace tests/traces/fixtures/traces/azure_small.csv \\
      --sweep 1,2 --duration 4 --model fast --model best --slo ttft=2000,tpot=100 --price-per-hour 3.5 \\
      --out runs/sweep
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem loadtest", description="Replay a workload mix or a real trace "
                                "against an OpenAI-compatible endpoint and write a report (docs/loadtest.md).",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="base URL of the endpoint, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None, help="bearer key (default: $TANDEM_API_KEY or $OPENAI_API_KEY)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--workload", choices=workload_names(), help="a built-in mix (lengths from real traces)")
    src.add_argument("--trace", help="a trace file: Azure 2023 CSV, BurstGPT CSV or Mooncake JSONL")
    p.add_argument("--trace-format", default="auto", choices=["auto", "azure", "burstgpt", "mooncake"])
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, help="mean requests/s (a trace is rescaled to it)")
    rate.add_argument("--sweep", help="comma-separated rates, one run each: R1,R2,...")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of arrivals (default 60 for a workload, the whole trace for a trace)")
    p.add_argument("--model", action="append", dest="models", metavar="ROUTE",
                   help="route or model name to send to; repeat to split traffic evenly (default: auto)")
    p.add_argument("--slo", action="append", default=[], metavar="ROUTE:ttft=MS,tpot=MS",
                   help="per-route SLO; omit ROUTE: for every route; e2e=MS also accepted")
    p.add_argument("--price-per-hour", type=float, default=None, help="USD per device-hour, for cost per 1k tokens")
    p.add_argument("--out", required=True, type=Path, help="report folder")
    p.add_argument("--tokenizer", default=None,
                   help="served model folder or tokenizer.json: prompts get exact token counts")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="served context length to scale lengths to (default: from /v1/models if given)")
    p.add_argument("--api", choices=["completions", "chat"], default="completions",
                   help="/v1/completions (exact prompt tokens, default) or /v1/chat/completions")
    p.add_argument("--arrivals", choices=["poisson", "gamma", "on_off", "trace"], default=None,
                   help="arrival process (default: the workload's measured one, or the trace's timestamps)")
    p.add_argument("--burstiness", type=float, default=None, help="gamma shape: 1 = Poisson, < 1 burstier")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply trace timestamps (without --rate)")
    p.add_argument("--trace-jitter", type=float, default=0.0, metavar="S",
                   help="spread trace requests uniformly over S seconds (Mooncake timestamps are ~3 s buckets)")
    p.add_argument("--concurrency", type=int, default=None, help="cap on requests in flight (default: none)")
    p.add_argument("--warmup", type=float, default=0.0, help="seconds at the start left out of the statistics")
    p.add_argument("--cooldown", type=float, default=0.0, help="seconds at the end left out of the statistics")
    p.add_argument("--seed", type=int, default=0, help="seed of arrivals and lengths")
    p.add_argument("--prompt-seed", type=int, default=None,
                   help="seed of the prompt text (default: fresh per run, so a warm prefix cache from an "
                        "earlier run cannot flatter the numbers; the report records it)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds without progress (connect, a read) before a request fails")
    p.add_argument("--scrape-interval", type=float, default=1.0, help="seconds between /metrics scrapes")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from traces.loadtest import LoadTestConfig, run
    from traces.metrics import parse_slo
    from traces.prompts import PromptSynthesisError
    from traces.workloads import WorkloadError

    try:
        slos = dict(parse_slo(s) for s in args.slo)
        sweep = [float(r) for r in args.sweep.split(",") if r.strip()] if args.sweep else None
    except ValueError as e:
        print(f"tandem loadtest: {e}", file=sys.stderr)
        return 2
    duration = args.duration if args.duration is not None else (None if args.trace else 60.0)
    cfg = LoadTestConfig(
        url=args.url, out=args.out, workload=args.workload, trace=args.trace, trace_format=args.trace_format,
        rate=args.rate, duration_s=duration, models=args.models or ["auto"], slos=slos,
        price_per_hour=args.price_per_hour,
        api_key=args.api_key or os.environ.get("TANDEM_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        api=args.api, tokenizer=args.tokenizer, max_model_len=args.max_model_len, arrivals=args.arrivals,
        burstiness=args.burstiness, time_scale=args.time_scale, trace_jitter_s=args.trace_jitter,
        concurrency=args.concurrency,
        warmup_s=args.warmup, cooldown_s=args.cooldown, seed=args.seed, prompt_seed=args.prompt_seed,
        timeout_s=args.timeout,
        temperature=args.temperature, scrape_interval_s=args.scrape_interval, plots=not args.no_plots,
        progress=not args.quiet and sys.stderr.isatty())
    try:
        result = run(cfg, sweep)
    except (WorkloadError, PromptSynthesisError) as e:
        print(f"tandem loadtest: {e}", file=sys.stderr)
        return 2
    if sweep:
        print((args.out / "sweep.md").read_text())
    else:
        print((args.out / "summary.md").read_text())
        for w in result["metadata"]["warnings"]:
            print(f"warning: {w}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
