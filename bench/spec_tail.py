"""TPOT tails of speculative and plain decoding at one load, with this machine's slow spells falling on both
alike. bench/spec_server.py's two engines (the widened tandem-tiny-l alone, and with tandem-tiny-s drafting,
built as `tandem serve MODEL [--draft ...]` builds them) live in one process, each with its own closed loop of
`--streams` streams (greedy, `--max-tokens` each, every stream sending its next request when one ends) on its
own clock: the sum of its steps' measured wall time. Whichever engine's clock is behind steps next, so the
two advance through the same minutes step by step. Alternated server runs cannot do that: this VM's compute
slows by 40-70% for seconds at a time (a 32-row step of the wide model takes 520-650 ms instead of 350-380,
with no other thread of the machine busy), and at 32 streams a round's TPOT p99 is its slowest cohort of
requests, so one such spell decides which server's p99 is worse.

A request's TPOT is (last token's time - first's) / (max_tokens - 1), its TTFT first token's time - its
arrival, on its engine's clock; the engine layer only (no HTTP: the gateway is the same code for both). Per
round: tok/s, TTFT p50, TPOT p50 / p99, drafted tokens and the steps of each kind; over the rounds the pooled
TPOT p99 ratio with a bootstrap interval. Writes bench/results/spec_tail.json.

    TANDEM_THREADS=1 .venv/bin/python bench/spec_tail.py [--streams 32] [--rounds 4] [--seconds 25]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402
from bench.spec_server import pooled_p99  # noqa: E402
from bench.speculative import SMALL, prompts_from_heldout  # noqa: E402
from engines import SamplingParams  # noqa: E402
from engines.tokenizer import Tokenizer  # noqa: E402
from training.widen import DEFAULT_FACTOR, cached_wide  # noqa: E402


def build_core(folder: Path, ctx: int, draft: Path | None, draft_quant: str, k: int):
    """The EngineCore `tandem serve FOLDER --served-model-name tandem --max-model-len CTX [--draft ...]` runs
    (not started: this script steps it)."""
    from engines import EngineCore
    from gateway.engine_setup import SERVER_RESERVED_CPUS, engine_core_args
    from gateway.server import build_parser, config_from_args

    argv = ["serve", str(folder), "--served-model-name", "tandem", "--max-model-len", str(ctx)]
    if draft is not None:
        argv += ["--draft", str(draft), "--draft-quantization", draft_quant, "--num-speculative-tokens", str(k)]
    args = build_parser().parse_args(argv[1:])
    specs, pool, device = engine_core_args(config_from_args(args))
    return EngineCore(specs, pool, device=device, reserve_cpus=SERVER_RESERVED_CPUS)


class Side:
    """One engine and its load on its own clock: a closed loop of `streams` streams, or (`phase(arrivals=...)`)
    requests arriving at given times whatever the engine's pace (an open loop)."""

    def __init__(self, name: str, core, prompts: list[list[int]], streams: int, max_tokens: int):
        self.name, self.core, self.engine = name, core, core.engines["tandem"]
        self.prompts, self.streams = prompts, streams
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.clock = 0.0
        self.stop = 0.0
        self.next_prompt = list(range(max(streams, 1)))
        self.closed = True
        self.arrivals: list[float] = []  # open loop: this phase's arrival times still to come, on this clock
        self.events: list[tuple[dict, int, bool, int]] = []  # this step's outputs: (request, new tokens, done, stream)
        self.finished: list[dict] = []
        self.live = 0
        self.kind = ""
        self.step_ms: dict[str, list[float]] = {}  # plan kind -> this phase's step times
        self.serial = 0
        choose = self.engine.policy.choose

        def counted(*a, **kw):  # the kinds of plan this side's steps ran (engines/step_plan.py)
            plan = choose(*a, **kw)
            self.kind = plan.kind + ("+drafts" if plan.drafts else "")
            return plan
        self.engine.policy.choose = counted
        schedule = self.engine.scheduler.schedule

        def booked(*a, **kw):  # what the step computes
            out = schedule(*a, **kw)
            self.booked = (out.num_prefill_tokens, out.num_decode_seqs, sum(map(len, out.drafts.values())))
            return out
        self.engine.scheduler.schedule = booked
        self.booked = (0, 0, 0)
        self.trace: list[tuple] | None = None  # --trace: (clock, step ms, kind, prefill tokens, decoding, drafts)

    def submit(self, stream: int, at: float | None = None) -> None:
        i = self.next_prompt[stream]
        self.next_prompt[stream] += len(self.next_prompt)
        rec = {"arrive": self.clock if at is None else at, "first": None, "last": None, "tokens": 0}
        self.serial += 1
        self.engine.add_request(self.prompts[i % len(self.prompts)], self.params, f"{self.name}-{self.serial}",
                                emit=lambda out, rec=rec, s=stream: self.events.append(
                                    (rec, len(out.outputs[0].delta_token_ids), out.finished, s)))
        self.live += 1

    def phase(self, seconds: float, arrivals: list[float] | None = None) -> None:
        """Start a closed loop of `seconds` on this side's clock (every stream sends a request now), or with
        `arrivals` (seconds from now) an open loop of those requests."""
        self.stop = self.clock + seconds
        self.finished = []
        self.step_ms = {}
        self.drafted0 = self.engine.speculator.stats().get("spec_num_draft_tokens", 0)
        self.closed = arrivals is None
        if arrivals is not None:
            self.arrivals = [self.clock + t for t in reversed(arrivals)]
            self.next_prompt = [0]
        else:
            self.next_prompt = list(range(self.streams))
            for s in range(self.streams):
                self.submit(s)

    @property
    def busy(self) -> bool:
        return bool(self.live or self.arrivals)

    def step(self) -> None:
        if not self.live and self.arrivals:  # idle until the next arrival
            self.clock = max(self.clock, self.arrivals[-1])
        while self.arrivals and self.arrivals[-1] <= self.clock:
            self.submit(0, self.arrivals.pop())
        t0 = time.perf_counter()
        self.kind = ""
        self.core.step()
        dt = time.perf_counter() - t0
        self.clock += dt
        if self.kind:
            self.step_ms.setdefault(self.kind, []).append(1e3 * dt)
            if self.trace is not None:
                self.trace.append((round(self.clock, 4), round(1e3 * dt, 2), self.kind, *self.booked))
        events, self.events = self.events, []
        for rec, n, done, stream in events:
            if n:
                rec["first"] = rec["first"] if rec["first"] is not None else self.clock
                rec["last"] = self.clock
                rec["tokens"] += n
            if done:
                self.live -= 1
                self.finished.append(rec)
                if self.closed and self.clock < self.stop:
                    self.submit(stream)

    def result(self, wall_s: float) -> dict:
        n = self.params.max_tokens
        tpots = [1e3 * (r["last"] - r["first"]) / max(n - 1, 1) for r in self.finished]
        ttfts = [1e3 * (r["first"] - r["arrive"]) for r in self.finished]
        drafted = self.engine.speculator.stats().get("spec_num_draft_tokens", 0) - self.drafted0
        return {"requests": len(tpots), "tok_s": sum(r["tokens"] for r in self.finished) / wall_s,
                "clock_s": wall_s, "ttft_p50_ms": float(np.percentile(ttfts, 50)),
                "tpot_p50_ms": float(np.percentile(tpots, 50)), "tpot_p99_ms": float(np.percentile(tpots, 99)),
                "drafted": drafted,
                "steps": {kind: {"n": len(ms), "p50_ms": float(np.percentile(ms, 50)),
                                 "p95_ms": float(np.percentile(ms, 95)), "max_ms": max(ms)}
                          for kind, ms in sorted(self.step_ms.items())},
                "tpots_ms": tpots}


def run_phase(sides: list[Side], seconds: float, arrivals: list[float] | None = None) -> dict[str, dict]:
    """Both loads for `seconds` of their own clocks (then until their last requests end), stepping whichever
    side's clock is behind."""
    start = {s.name: s.clock for s in sides}
    for s in sides:
        s.phase(seconds, arrivals)
    while any(s.busy for s in sides):
        busy = [s for s in sides if s.busy]
        min(busy, key=lambda s: s.clock - start[s.name]).step()
    return {s.name: s.result(s.clock - start[s.name]) for s in sides}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=32, help="closed loop: streams sending one request after another")
    ap.add_argument("--rate", type=float, default=None,
                    help="open loop instead: requests per second arriving at Poisson times (the same for both)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=25.0, help="closed-loop seconds per round, each engine's clock")
    ap.add_argument("--warmup-seconds", type=float, default=6.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--draft-quantization", default="w8a8", choices=["none", "int8", "w8a8"])
    ap.add_argument("--trace", action="store_true", help="every step of each side in the results (kind, ms, tokens)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "spec_tail.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("TANDEM_THREADS", "1")
    folder = cached_wide(DEFAULT_FACTOR)
    prompts = prompts_from_heldout(Tokenizer.from_pretrained(folder), 48, args.prompt_tokens, seed=7)
    ctx = args.prompt_tokens + args.max_tokens + 16
    sides = [Side("plain", build_core(folder, ctx, None, args.draft_quantization, args.k), prompts, args.streams,
                  args.max_tokens),
             Side("spec", build_core(folder, ctx, SMALL, args.draft_quantization, args.k), prompts, args.streams,
                  args.max_tokens)]
    load0 = os.getloadavg()
    rng = np.random.default_rng(0)

    def arrivals(seconds: float) -> list[float] | None:
        if args.rate is None:
            return None
        t = np.cumsum(rng.exponential(1.0 / args.rate, int(seconds * args.rate * 2) + 10))
        return [float(x) for x in t[t < seconds]]
    run_phase(sides, args.warmup_seconds, arrivals(args.warmup_seconds))
    for side in sides:
        side.trace = [] if args.trace else None
    rounds = []
    for r in range(args.rounds):
        res = run_phase(sides, args.seconds, arrivals(args.seconds))
        rounds.append(res)
        p, s = res["plain"], res["spec"]
        print(f"round {r}: tok/s {p['tok_s']:.1f} / {s['tok_s']:.1f} ({s['tok_s'] / p['tok_s']:.3f}x), TTFT p50 "
              f"{p['ttft_p50_ms']:.0f} / {s['ttft_p50_ms']:.0f} ms, TPOT p50 {p['tpot_p50_ms']:.1f} / "
              f"{s['tpot_p50_ms']:.1f}, p99 {p['tpot_p99_ms']:.1f} / {s['tpot_p99_ms']:.1f} ms "
              f"({s['tpot_p99_ms'] / p['tpot_p99_ms']:.3f}x); drafted {s['drafted']}", flush=True)
    ratios = [rd["spec"]["tpot_p99_ms"] / rd["plain"]["tpot_p99_ms"] for rd in rounds]
    rates = [rd["spec"]["tok_s"] / rd["plain"]["tok_s"] for rd in rounds]
    print(f"per round, speculative / plain: TPOT p99 median {np.median(ratios):.3f}x ({min(ratios):.3f}-"
          f"{max(ratios):.3f}), tok/s median {np.median(rates):.3f}x ({min(rates):.3f}-{max(rates):.3f})")
    pooled = pooled_p99({name: [rd[name] for rd in rounds] for name in ("plain", "spec")})
    print(f"pooled TPOT p99 plain {pooled['tpot_p99_ms']['plain']:.1f} ms, speculative "
          f"{pooled['tpot_p99_ms']['spec']:.1f} ms: {pooled['ratio']:.3f}x (95% interval "
          f"{pooled['ratio_ci95'][0]:.3f}-{pooled['ratio_ci95'][1]:.3f})")
    write_results(args.out, {
        "bench": "spec_tail", "load": "open" if args.rate else "closed", "rate": args.rate, "streams": args.streams, "seconds": args.seconds, "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens, "k": args.k, "draft_quantization": args.draft_quantization,
        "threads": int(os.environ["TANDEM_THREADS"]), "load_before": load0, "load_after": os.getloadavg(),
        "rounds": [{name: {k: v for k, v in side.items() if k != "tpots_ms"} for name, side in rd.items()}
                   for rd in rounds],
        "tpots_ms": {name: [rd[name]["tpots_ms"] for rd in rounds] for name in ("plain", "spec")},
        "round_ratio_tpot_p99": ratios, "round_ratio_tok_s": rates,
        "median_ratio_tpot_p99": float(np.median(ratios)), "median_ratio_tok_s": float(np.median(rates)),
        "pooled_tpot_p99": pooled,
        **({"trace": {side.name: side.trace for side in sides}} if args.trace else {})})
    return 0


if __name__ == "__main__":
    sys.exit(main())
