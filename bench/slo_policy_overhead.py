"""Per-call cost of the SLO policies on the request path and in the step loop: waiting-queue push/pop at
depth, step-model update, batch caps, admission (admit + first token), SLO observation, a full route report,
and one autoscale evaluation. Prints a table and writes bench/results/slo_policy_overhead.json.

    .venv/bin/python bench/slo_policy_overhead.py [--n 20000] [--depth 10000] [--rounds 5]

The CPU is shared, so each row reports the best of `rounds` runs (the least disturbed one).
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402
from engines.step_model import BatchCapController, StepTimeModel  # noqa: E402
from engines.waiting_queue import WaitingQueue  # noqa: E402
from gateway.admission import AdmissionController  # noqa: E402
from gateway.autoscale import Autoscaler, ScaleSignals  # noqa: E402
from gateway.config import RouteConfig, SLOConfig  # noqa: E402
from gateway.slo import SLOAccounting  # noqa: E402

ROUTES = {"interactive": RouteConfig(engines=["large"], priority=0, slo=SLOConfig(ttft_ms=500, tpot_ms=50)),
          "batch": RouteConfig(engines=["large"], priority=1, slo=SLOConfig(ttft_ms=10_000))}


def best_us(fn: Callable[[int], None], n: int, rounds: int) -> float:
    """Best-of-rounds microseconds per call of fn (which runs n calls)."""
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn(n)
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--depth", type=int, default=10000, help="waiting-queue depth for push/pop")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    rows: dict[str, float] = {}

    queue = WaitingQueue(lambda item: item, aging_s=30.0)
    for i in range(args.depth):
        queue.push((i, rng.randint(0, 2), rng.uniform(0, 100)))
    counter = [args.depth]

    def queue_cycle(n: int) -> None:
        for _ in range(n):
            counter[0] += 1
            queue.push((counter[0], counter[0] % 3, counter[0] * 0.001))
            queue.pop()
    rows[f"waiting queue push+pop at depth {args.depth}"] = best_us(queue_cycle, args.n, args.rounds)

    model = StepTimeModel()
    samples = [(0.002 + 0.0005 * d + 0.00002 * p, d, p) for d, p in
               ((rng.randint(1, 64), rng.choice([0, 64, 512])) for _ in range(1024))]

    def observe(n: int) -> None:
        for i in range(n):
            s, d, p = samples[i & 1023]
            model.observe(s, d, p)
    rows["step model observe"] = best_us(observe, args.n, args.rounds)

    ctl = BatchCapController(max_num_seqs=64, max_num_batched_tokens=512, model=model)
    ctl.targets.add(0.05)

    def caps(n: int) -> None:
        for i in range(n):
            ctl.caps(i & 63)
    rows["batch caps"] = best_us(caps, args.n, args.rounds)

    clock_t = [0.0]
    adm = AdmissionController(ROUTES, engine_slots={"large": 64}, clock=lambda: clock_t[0])

    def admission(n: int) -> None:  # a request's whole life: admit, first token, release (8 waiting, 8 running)
        for i in range(n):
            rid = str(i)
            clock_t[0] += 0.001
            adm.admit(rid, "interactive" if i & 1 else "batch", "large", 100 + (i & 255))
            if i >= 8:
                adm.first_token(str(i - 8))
            if i >= 16:
                adm.release(str(i - 16))
        for i in range(max(0, n - 8), n):
            adm.first_token(str(i))
        for i in range(max(0, n - 16), n):
            adm.release(str(i))
    rows["admission admit + first_token + release (8 waiting, 8 running)"] = best_us(admission, args.n, args.rounds)

    acc = SLOAccounting(ROUTES, window_s=300, price_per_device_hour=3.0, clock=lambda: clock_t[0])

    def slo_observe(n: int) -> None:
        for i in range(n):
            clock_t[0] += 0.01
            acc.observe_request("interactive", "large", ttft_s=0.05 + (i & 127) * 0.003,
                                tpot_s=0.02 + (i & 31) * 0.001, prompt_tokens=200, output_tokens=100)
    rows["slo observe_request"] = best_us(slo_observe, args.n, args.rounds)
    rows["slo reports() (2 routes, full window)"] = best_us(lambda n: [acc.reports() for _ in range(n)],
                                                            max(1, args.n // 100), args.rounds)

    scaler = Autoscaler(clock=lambda: clock_t[0])
    signals = ScaleSignals(current_replicas=2, waiting_per_replica=12, kv_usage=0.5,
                           slo_attainment={"interactive": 0.995}, slo_targets={"interactive": 0.99})

    def autoscale(n: int) -> None:
        for _ in range(n):
            clock_t[0] += 15
            scaler.evaluate(signals)
    rows["autoscale evaluate"] = best_us(autoscale, max(1, args.n // 10), args.rounds)

    width = max(len(k) for k in rows)
    print(f"{'operation':<{width}}  us/call")
    for name, us in rows.items():
        print(f"{name:<{width}}  {us:8.2f}")
    out = ROOT / "bench" / "results" / "slo_policy_overhead.json"
    write_results(out, {"python": platform.python_version(), "machine": platform.machine(),
                               "args": vars(args), "us_per_call": rows}, indent=2)
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
