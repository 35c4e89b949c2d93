"""SLO-aware serving vs plain first-come-first-served: goodput on the Azure conversation mix at rising rates.

Starts real tandem servers (subprocesses on 127.0.0.1, default tiny model), one per mode:
- `slo`: priority + TTFT-deadline order, TPOT batch caps, admission control (predict TTFT, shed 503) and
  deadline-aware dropping of waiting requests that can no longer make their TTFT;
- `fcfs`: plain first-come-first-served (vLLM's default policy): arrival order, no priorities, every request
  admitted and served however late;
- `priority` (a stronger reference baseline): the route priorities, then arrival order, every request admitted.
Drives each with the load tester (`traces`, the `chat` mix from the Azure 2023 conversation trace) split over
an `interactive` route (tight SLO, high priority) and a `batch` route (loose SLO), and compares goodput
(requests meeting every SLO of their route per second; shed and failed requests are misses).

Target: >= 1.5x goodput vs FCFS at the knee. The knee is where offered load reaches the engine's capacity
(saturation), and capacity is measured in the run: FCFS's service rate (requests completed per second while
the measured window's arrivals go on) at the points where FCFS was overloaded throughout (`capacity`). The knee
is the first rate whose offered load is at or above it. Two earlier definitions are still printed and written
(`knees`): the first rate where FCFS attainment drops under 90%, and FCFS's peak goodput. Mind the bound: the
SLO-aware goodput cannot exceed the offered load, so at any rate the ratio is at most 1 / (FCFS attainment
there): at the first rate under 90% on a fine grid that is at most about 1.1-1.2x whatever the scheduler does,
and at a knee just past capacity it is what FCFS's own collapse allows (printed as the bound). Runs are 30 s per
rate by default: in 10 s runs the queue that builds during arrivals still drains within the batch route's 5 s
TTFT target after arrivals stop (at 40-60 req/s, with the load generator off the CPU), so FCFS looks fine well
past capacity. Also reports the admission predictor's error (predicted vs actual TTFT of admitted requests) and,
per route, where each request went (met, late, shed, dropped). Prints a table, writes bench/results/slo.json
and docs/img/slo_goodput.png (`--name` changes the stem).

    .venv/bin/python bench/slo.py [--rates 24,28,30,32,34,36,44,56] [--duration 30] [--modes slo,fcfs,priority]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.results_meta import write_results  # noqa: E402
from traces.loadtest import LoadTestConfig, load_records, run_once, sweep_point  # noqa: E402
from traces.metrics import Slo, in_window, meets, route_of  # noqa: E402

RESULTS_DIR = ROOT / "bench" / "results"
PLOT_DIR = ROOT / "docs" / "img"
SLOS = {"interactive": Slo(ttft_ms=1000, tpot_ms=200), "batch": Slo(ttft_ms=5000, tpot_ms=400)}
MODES = ("slo", "fcfs", "priority")
LABELS = {"slo": "SLO-aware (deadlines + caps + admission + dropping)", "fcfs": "plain FCFS (arrival order)",
          "priority": "priority FCFS (route priority, then arrival)"}


def config_for(mode: str, engine: Path) -> str:
    slo_on = mode == "slo"
    flag = "true" if slo_on else "false"
    i, b = SLOS["interactive"], SLOS["batch"]
    prio_i, prio_b = (0, 0) if mode == "fcfs" else (-1, 1)
    return f"""
[server]
max_inflight_requests = 4096
log_level = "warning"

[kv_pool]
memory_bytes = "256MiB"
enable_prefix_caching = true

[engines.tandem]
checkpoint = "{engine}"
max_num_seqs = 64
max_num_batched_tokens = 512
slo_scheduling = {flag}
priority_aging_s = 1.0  # near earliest-deadline-first: batch requests are not starved past their 5 s target
drop_expired_requests = {flag}

[admission]
enabled = {flag}
rate_halflife_s = 3.0
ttft_slack = 0.9  # aim a little under the target: the prediction is a corrected mean

[routes.interactive]
engines = ["tandem"]
priority = {prio_i}
max_waiting = 64  # about what 1 s of interactive arrivals at the top rate fill
slo = {{ ttft_ms = {i.ttft_ms:g}, tpot_ms = {i.tpot_ms:g} }}

[routes.batch]
engines = ["tandem"]
priority = {prio_b}
max_waiting = 256  # about what 5 s of batch arrivals at the top rate fill
slo = {{ ttft_ms = {b.ttft_ms:g}, tpot_ms = {b.tpot_ms:g} }}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`tandem serve` in a subprocess (its own interpreter: the load generator does not share its GIL)."""

    def __init__(self, config: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        code = "import sys; from gateway.server import main; sys.exit(main(sys.argv[1:]))"
        self.proc = subprocess.Popen([sys.executable, "-c", code, "--config", str(config), "--port", str(self.port)],
                                     cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env=os.environ | {"OTEL_TRACES_SAMPLER": "always_off"})

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server not ready in time")

    def warm(self) -> None:
        """A few sequential requests: the engine's step model and the admission's prefill rate get data."""
        for i in range(8):
            httpx.post(self.url + "/v1/completions", timeout=60, json={
                "model": "interactive", "prompt": "warm up " * (20 + 20 * i), "max_tokens": 16, "ignore_eos": True})

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _fates(report: dict) -> dict[str, dict[str, int]]:
    """Per route, where the requests scheduled in the measured window went: met every SLO, completed late
    (TTFT missed, or only TPOT missed), shed at admission, dropped past their TTFT deadline, failed."""
    start, end = report["summary"]["window_s"]
    out: dict[str, dict[str, int]] = {}
    for rec in in_window(load_records(report), start, end):
        route = route_of(rec)
        if rec.outcome == "completed":
            ok = meets(rec, SLOS.get(route))
            fate = "met" if all(ok.values()) else "late_tpot" if ok.get("ttft", True) else "late_ttft"
        elif rec.outcome == "shed":
            fate = "dropped" if "ttft_deadline_exceeded" in (rec.error or "") else "shed"
        else:
            fate = "failed"
        counts = out.setdefault(route, {})
        counts[fate] = counts.get(fate, 0) + 1
    return out


def service_rate(report: dict) -> float:
    """Requests completed per second while the measured window's arrivals were still coming in (by completion
    time, whenever they were sent): the engine's sustained service rate when it is overloaded throughout."""
    start, end = report["summary"]["window_s"]
    done = sum(1 for r in report["records"] if r["outcome"] == "completed" and start <= r["end_s"] < end)
    return done / max(end - start, 1e-9)


def _point(rate: float, report: dict) -> dict:
    s = report["summary"]
    p = sweep_point(rate, report)
    return {
        "rate": rate, "offered_rps": round(p["offered_rate_rps"], 3), "sent": p["sent"],
        "completed": p["completed"], "shed": p["shed"], "failed": p["failed"],
        "goodput_rps": round(p["goodput_rps"] or 0.0, 3), "slo_attainment": round(p["slo_attainment"] or 0, 4),
        "throughput_rps": round(p["request_throughput_rps"], 3),
        "ttft_p99_ms": p["ttft_p99_ms"], "tpot_p99_ms": p["tpot_p99_ms"],
        "service_rps": round(service_rate(report), 3), "fates": _fates(report),
        "per_route": {name: {"completed": r["completed"], "shed": r["shed"], "failed": r["failed"],
                             "attainment": r.get("slo", {}).get("attainment", {}).get("combined"),
                             "ttft_p99_ms": r["ttft_ms"]["p99"], "tpot_p99_ms": r["tpot_ms"]["p99"]}
                      for name, r in s["per_route"].items()}}


def _admission_stats(url: str) -> dict | None:
    try:
        return httpx.get(url + "/v1/routes", timeout=10).json().get("admission")
    except (httpx.HTTPError, ValueError):
        return None


def prediction_delta(before: dict | None, after: dict | None) -> dict[str, dict]:
    """Predicted vs actual TTFT of the requests admitted between two `/v1/routes` snapshots, per priority."""
    out: dict[str, dict] = {}
    if not after:
        return out
    prev = (before or {}).get("prediction", {})
    for engine, by_prio in after.get("prediction", {}).items():
        for prio, a in by_prio.items():
            b = prev.get(engine, {}).get(prio, {"count": 0, "mean_error_s": 0.0, "mean_abs_error_s": 0.0,
                                                   "within_20pct": 0.0, "late": 0.0})
            n = a["count"] - b["count"]
            if n > 0:  # the totals are means over all requests so far: take the new requests' share
                out[f"{engine}/{prio}"] = {"count": n, **{
                    key: round((a[key] * a["count"] - b[key] * b["count"]) / n, 4)
                    for key in ("mean_error_s", "mean_abs_error_s", "within_20pct", "late")}}
    return out


def run_modes(engine: Path, rates: list[float], duration_s: float, out: Path,
              modes: list[str]) -> dict[str, list[dict]]:
    """Every server up at once (an idle engine thread sleeps); per rate the modes run back to back, in
    rotating order, so a change in the shared machine's load hits them alike."""
    servers = {}
    try:
        for mode in modes:
            config = out / f"{mode}.toml"
            config.write_text(config_for(mode, engine))
            servers[mode] = Server(config)
        for server in servers.values():
            server.wait_ready()
            server.warm()
        points: dict[str, list[dict]] = {mode: [] for mode in modes}
        for i, rate in enumerate(sorted(rates)):
            order = modes[i % len(modes):] + modes[:i % len(modes)]
            for mode in order:
                before = _admission_stats(servers[mode].url) if mode == "slo" else None
                cfg = LoadTestConfig(url=servers[mode].url, out=out / mode, workload="chat", duration_s=duration_s,
                                     models=["interactive", "batch"], slos=SLOS, tokenizer=str(engine),
                                     warmup_s=2.0, seed=0, prompt_seed=0, timeout_s=60.0, plots=False,
                                     scrape_interval_s=2.0)
                report = asyncio.run(run_once(cfg, rate, out / mode / f"rate_{rate:g}", 512, i))
                points[mode].append(_point(rate, report))
                if mode == "slo":
                    after = _admission_stats(servers[mode].url)
                    points[mode][-1]["ttft_prediction"] = prediction_delta(before, after)
                    old = (before or {}).get("decisions", {})
                    points[mode][-1]["admission_decisions"] = {
                        k: n - old.get(k, 0) for k, n in sorted((after or {}).get("decisions", {}).items())
                        if n - old.get(k, 0)}
                print(f"rate {rate:g} {mode}: goodput {points[mode][-1]['goodput_rps']:.2f}", file=sys.stderr)
        return points
    finally:
        for server in servers.values():
            server.stop()


def capacity(fcfs: list[dict]) -> float | None:
    """The engine's capacity, measured in the run: the median of FCFS's service rate over the points where it was
    overloaded throughout the window (it completed under 90% of the offered rate there). FCFS admits and serves
    everything in arrival order with a full batch, so that is what this engine sustains on this mix while the
    arrivals (and the load generator on the same CPU) go on. None if no point overloaded it."""
    loaded = sorted(p["service_rps"] for p in fcfs if p["service_rps"] < 0.9 * p["offered_rps"])
    if not loaded:
        return None
    mid = len(loaded) // 2
    return loaded[mid] if len(loaded) % 2 else (loaded[mid - 1] + loaded[mid]) / 2


def knees(fcfs: list[dict], cap: float | None) -> dict[str, float | None]:
    """The rate (grid point) of each knee definition: `capacity` (the principled one, the first point whose
    offered load reaches the measured capacity: saturation), and the two earlier ones kept for comparison,
    `attainment_90` (the first point where FCFS attainment drops under 90%) and `fcfs_peak` (FCFS's best
    goodput)."""
    at_capacity = next((p["rate"] for p in fcfs if cap is not None and p["offered_rps"] >= cap), None)
    under_90 = next((p["rate"] for p in fcfs if p["slo_attainment"] < 0.90), None)
    peak = max(fcfs, key=lambda p: p["goodput_rps"])["rate"] if fcfs else None
    return {"capacity": at_capacity, "attainment_90": under_90, "fcfs_peak": peak}


def plot(results: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib missing: plot skipped"
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for mode, pts in results["modes"].items():
        label = LABELS[mode]
        ax.plot([p["offered_rps"] for p in pts], [p["goodput_rps"] for p in pts], marker="o", label=label)
    if results["capacity_rps"] is not None:
        ax.axvline(results["capacity_rps"], color="grey", ls=":", lw=1,
                   label=f"measured capacity {results['capacity_rps']:.1f} req/s (knee)")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("goodput (requests/s meeting every SLO)")
    ax.set_title("tandem: goodput, Azure conversation mix, tiny model on CPU")
    ax.grid(alpha=0.3)
    top = max(p["goodput_rps"] for pts in results["modes"].values() for p in pts)
    ax.set_ylim(0, top * 1.5)  # room for the legend above the curves
    ax.legend(fontsize=8, loc="upper right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="24,28,30,32,34,36,44,56", help="offered rates, requests/s")
    parser.add_argument("--modes", default=",".join(MODES), help="which of slo,fcfs,priority to run")
    parser.add_argument("--name", default="slo", help="writes bench/results/NAME.json, docs/img/NAME_goodput.png")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    parser.add_argument("--keep", type=Path, help="keep the configs and per-rate reports in this folder")
    parser.add_argument("--engine", type=Path, default=ROOT / "models" / "tandem-tiny-l")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if "slo" not in modes or "fcfs" not in modes or set(modes) - set(MODES):
        parser.error(f"--modes must include slo and fcfs and name only {MODES}")
    started = time.monotonic()
    results: dict = {"workload": "chat (Azure LLM inference trace 2023, conversation)", "engine": str(args.engine),
                     "rates": rates, "duration_s": args.duration,
                     "slos": {k: vars(v) for k, v in SLOS.items()}, "modes": {},
                     "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), torch CPU",
                     "command": "bench/slo.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    rates = sorted(rates)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)  # configs and each rate's report.json (every request's record)
        work.mkdir(parents=True, exist_ok=True)
        results["modes"] = run_modes(args.engine.resolve(), rates, args.duration, work, modes)
    fcfs = results["modes"]["fcfs"]
    cap = capacity(fcfs)
    results["capacity_rps"] = round(cap, 3) if cap is not None else None
    results["knees"] = knees(fcfs, cap)
    k = results["knee_rate"] = results["knees"]["capacity"]
    ratios = {}
    for s, f in zip(results["modes"]["slo"], results["modes"]["fcfs"]):
        ratios[f"{s['rate']:g}"] = round(s["goodput_rps"] / f["goodput_rps"], 3) if f["goodput_rps"] else None
    results["goodput_ratio"] = ratios
    results["ratio_at_knee"] = ratios.get(f"{k:g}") if k is not None else None
    results["ratio_at_knees"] = {name: ratios.get(f"{r:g}") if r is not None else None
                                 for name, r in results["knees"].items()}
    # the bound: at any rate the ratio is at most 1 / FCFS attainment there (SLO-aware goodput <= offered load)
    results["ratio_bound_at_knees"] = {
        name: next((round(1 / p["slo_attainment"], 3) if p["slo_attainment"] else None
                    for p in fcfs if p["rate"] == r), None) for name, r in results["knees"].items()}
    if "priority" in results["modes"]:
        results["goodput_ratio_vs_priority"] = {
            f"{s['rate']:g}": round(s["goodput_rps"] / q["goodput_rps"], 3) if q["goodput_rps"] else None
            for s, q in zip(results["modes"]["slo"], results["modes"]["priority"])}
    results["target_met"] = results["ratio_at_knee"] is not None and results["ratio_at_knee"] >= 1.5
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    results_path, plot_path = RESULTS_DIR / f"{args.name}.json", PLOT_DIR / f"{args.name}_goodput.png"
    warning = plot(results, plot_path)
    if warning:
        results["plot_warning"] = warning

    print(f"{'rate':>5} | {'mode':>4} | {'offered':>7} | {'goodput':>7} | {'attain':>6} | {'done':>4} | "
          f"{'shed':>4} | {'fail':>4} | {'served/s':>8} | {'TTFT p99 ms':>11} | {'TPOT p99 ms':>11} | int. TTFT p99")
    for i, rate in enumerate(rates):
        for mode in modes:
            p = results["modes"][mode][i]
            inter = p["per_route"].get("interactive", {}).get("ttft_p99_ms")
            print(f"{rate:>5g} | {mode:>4} | {p['offered_rps']:>7.2f} | {p['goodput_rps']:>7.2f} | "
                  f"{p['slo_attainment']:>6.1%} | {p['completed']:>4} | {p['shed']:>4} | {p['failed']:>4} | "
                  f"{p['service_rps']:>8.1f} | "
                  f"{_num(p['ttft_p99_ms']):>11} | {_num(p['tpot_p99_ms']):>11} | {_num(inter)}")
    print(f"capacity (FCFS service rate while overloaded): {results['capacity_rps']} req/s; service rate per rate: "
          + ", ".join(f"{p['rate']:g}: {p['service_rps']:.1f}" for p in fcfs))
    print(f"knee (first offered load >= capacity): {k} req/s; goodput ratio there: {results['ratio_at_knee']} "
          f"(target >= 1.5: {'met' if results['target_met'] else 'NOT met'}; at most 1 / FCFS attainment = "
          f"{results['ratio_bound_at_knees']['capacity']}); ratios {ratios}")
    for name, label in (("attainment_90", "first FCFS attainment < 90%"), ("fcfs_peak", "FCFS peak goodput")):
        print(f"earlier knee definition ({label}): {results['knees'][name]} req/s; ratio there "
              f"{results['ratio_at_knees'][name]} (bound {results['ratio_bound_at_knees'][name]})")
    if "goodput_ratio_vs_priority" in results:
        print(f"SLO-aware vs priority FCFS: {results['goodput_ratio_vs_priority']}")
    print("where the SLO-aware mode's requests went (route: fate count):")
    for p in results["modes"]["slo"]:
        print(f"  rate {p['rate']:g}: {p['fates']}")
    print("admission decisions (route/action/reason: count):")
    for p in results["modes"]["slo"]:
        print(f"  rate {p['rate']:g}: {p.get('admission_decisions', {})}")
    print("admission TTFT prediction (admitted requests; error = actual - predicted):")
    for p in results["modes"]["slo"]:
        for key, e in p.get("ttft_prediction", {}).items():
            print(f"  rate {p['rate']:g} {key}: n={e['count']} mean error {e['mean_error_s'] * 1000:+.0f} ms, "
                  f"mean |error| {e['mean_abs_error_s'] * 1000:.0f} ms, within max(20%, 50 ms): "
                  f"{e['within_20pct']:.0%}, TTFT over target: {e['late']:.0%}")
    write_results(results_path, results, indent=2)
    print(f"wrote {results_path.relative_to(ROOT)} and {plot_path.relative_to(ROOT)} in {results['elapsed_s']} s")
    return 0


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


if __name__ == "__main__":
    raise SystemExit(main())
