"""What the gateway's slow requests at --rate have in common (issue 41): each request's time inside the server.

The gateway of bench/gateway_overhead.py (instant fake engine) runs with probes: every ASGI call's wall time,
its thread's CPU time and its time runnable but waiting for a CPU (/proc/self/task/<tid>/schedstat), every GC
pass (gc.callbacks: generation, duration), and a 1 ms loop-lag monitor. One client drives it open-loop
(Poisson, streamed); the table splits the requests slower than --slow-ms by what they overlapped.

    .venv/bin/python bench/gateway_tail.py [--rate 1000] [--duration 8] [--slow-ms 2]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway_overhead import drive, serve_gateway  # noqa: E402
from bench.results_meta import write_results  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "gateway_tail.json"


def serve_probed(port: int, out: str) -> None:
    """The bench gateway with the probes; SIGUSR1 writes what they saw to `out` and ends the process."""
    import gateway.server as server

    passes: list[tuple[float, float, int]] = []  # (start, seconds, generation)
    requests: list[tuple[float, float, float, float]] = []  # (start, wall, on a CPU, runnable waiting) seconds
    lags: list[tuple[float, float]] = []
    began: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            began.append(time.perf_counter())
        elif began:
            t0 = began.pop()
            passes.append((t0, time.perf_counter() - t0, info["generation"]))

    gc.callbacks.append(on_gc)
    stat = None

    def waited() -> float:
        nonlocal stat
        if stat is None:
            stat = open(f"/proc/self/task/{threading.get_native_id()}/schedstat", "rb", buffering=0)
        stat.seek(0)
        return int(stat.read().split()[1]) / 1e9

    async def monitor() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append((t, time.perf_counter() - t - 0.001))

    build = server.build_server

    def build_probed(cfg, app, **kwargs):
        srv = build(cfg, app, **kwargs)
        inner, monitoring = srv.config.app, []

        async def probed(scope, receive, send):
            if scope["type"] != "http":
                return await inner(scope, receive, send)
            if not monitoring:
                monitoring.append(asyncio.get_running_loop().create_task(monitor()))
            t0, c0, w0 = time.perf_counter(), time.thread_time(), waited()
            try:
                await inner(scope, receive, send)
            finally:
                requests.append((t0, time.perf_counter() - t0, time.thread_time() - c0, waited() - w0))

        srv.config.app = probed
        return srv

    server.build_server = build_probed

    def dump(*_) -> None:
        Path(out).write_text(json.dumps({"gc": passes, "requests": requests, "lags": lags,
                                         "freeze_count": gc.get_freeze_count(), "threshold": gc.get_threshold()}))
        os._exit(0)

    signal.signal(signal.SIGUSR1, dump)
    serve_gateway(port)


def analyse(seen: dict, t_from: float, slow_ms: float) -> dict:
    reqs = np.asarray([r for r in seen["requests"] if r[0] >= t_from]).reshape(-1, 4)
    passes = [p for p in seen["gc"] if p[0] >= t_from]
    ms = reqs[:, 1:] * 1000
    slow = ms[:, 0] > slow_ms

    def overlaps_gc(start: float, wall: float) -> bool:
        return any(p[0] < start + wall and p[0] + p[1] > start for p in passes)

    slow_rows = reqs[slow]
    gc_hit = sum(overlaps_gc(r[0], r[1]) for r in slow_rows)
    mostly_waiting = int((ms[slow, 2] > ms[slow, 0] / 2).sum())
    lag = np.asarray([x[1] for x in seen["lags"] if x[0] >= t_from]) * 1000
    pct = lambda a, q: float(np.percentile(a, q)) if len(a) else None  # noqa: E731
    return {
        "requests": int(len(reqs)), "slow_ms": slow_ms, "slow": int(slow.sum()),
        "wall_ms": {"p50": pct(ms[:, 0], 50), "p99": pct(ms[:, 0], 99), "max": float(ms[:, 0].max())},
        "on_cpu_ms": {"p50": pct(ms[:, 1], 50), "p99": pct(ms[:, 1], 99), "max": float(ms[:, 1].max())},
        "runnable_waiting_ms": {"p50": pct(ms[:, 2], 50), "p99": pct(ms[:, 2], 99), "max": float(ms[:, 2].max())},
        "slow_median_ms": {"wall": pct(ms[slow, 0], 50), "on_cpu": pct(ms[slow, 1], 50),
                           "runnable_waiting": pct(ms[slow, 2], 50)},
        "slow_mostly_runnable_waiting": mostly_waiting, "slow_overlapping_a_gc_pass": int(gc_hit),
        "gc_passes": {f"gen{g}": {"n": len(d), "total_ms": 1000 * sum(d), "max_ms": 1000 * max(d, default=0.0)}
                      for g in (0, 1, 2) for d in [[p[1] for p in passes if p[2] == g]]},
        "loop_lag_ms": {"p50": pct(lag, 50), "p99": pct(lag, 99), "max": float(lag.max()) if len(lag) else None},
        "freeze_count": seen["freeze_count"], "gc_threshold": seen["threshold"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--slow-ms", type=float, default=2.0, help="a request slower than this inside the server")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve_probed(args.serve, args.out)
        return 0
    from bench.gateway_ab import _port, _wait

    port, out = _port(), f"/tmp/gateway_tail_{os.getpid()}.json"
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--out", out], cwd=ROOT)
    try:
        _wait(proc, port, b"/ready", "the probed gateway")
        drive(port, "stream", 50, 1.0)  # warm-up: connections, first-request paths
        load0, t_from = os.getloadavg()[0], time.perf_counter()  # CLOCK_MONOTONIC: the server's clock too
        row = drive(port, "stream", args.rate, args.duration)
        load1 = os.getloadavg()[0]
        proc.send_signal(signal.SIGUSR1)
        proc.wait(30)
        seen = json.loads(Path(out).read_text())
    finally:
        if proc.poll() is None:
            proc.kill()
        Path(out).unlink(missing_ok=True)
    result = analyse(seen, t_from, args.slow_ms)
    client = {"ok": row["ok"], "errors": row["errors"], "p50_ms": row["p50_ms"], "p99_ms": row["p99_ms"],
              "dispatch_lag_p99_ms": row["dispatch_lag_p99_ms"]}
    print(f"{args.rate:g} req/s streamed for {args.duration:g} s, load average {load0:.1f} -> {load1:.1f} on "
          f"{os.cpu_count()} cores; client: p50 {client['p50_ms']:.2f} ms, p99 {client['p99_ms']:.2f} ms, its own "
          f"dispatch lag p99 {client['dispatch_lag_p99_ms']:.2f} ms, {client['errors']} errors")
    print(f"{'inside the server, per request':<34}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    for key, label in (("wall_ms", "wall"), ("on_cpu_ms", "on a CPU"), ("runnable_waiting_ms", "runnable, waiting")):
        v = result[key]
        print(f"  {label:<32}{v['p50']:>9.3f}{v['p99']:>9.3f}{v['max']:>9.3f}")
    lag = result["loop_lag_ms"]
    print(f"  {'loop lag (1 ms sleeps)':<32}{lag['p50']:>9.3f}{lag['p99']:>9.3f}{lag['max']:>9.3f}")
    s = result["slow_median_ms"]
    print(f"slower than {args.slow_ms:g} ms: {result['slow']} of {result['requests']}; their median wall {s['wall']:.2f} "
          f"ms = {s['on_cpu']:.2f} on a CPU + {s['runnable_waiting']:.2f} runnable but waiting; "
          f"{result['slow_mostly_runnable_waiting']} waited more than half their time, "
          f"{result['slow_overlapping_a_gc_pass']} overlapped a GC pass")
    print("GC passes during the run: " + ", ".join(f"{g} {v['n']} ({v['total_ms']:.1f} ms, max {v['max_ms']:.2f})"
                                                  for g, v in result["gc_passes"].items())
          + f"; frozen objects {result['freeze_count']}, thresholds {tuple(result['gc_threshold'])}")
    write_results(RESULTS, {"bench": "gateway_tail", "rate": args.rate, "duration_s": args.duration,
                            "load_average": [load0, load1], "client": client, **result}, indent=1)
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
