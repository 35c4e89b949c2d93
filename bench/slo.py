"""SLO-aware serving vs plain first-come-first-served: goodput on the Azure conversation mix at rising rates.

Starts real tandem servers (subprocesses on 127.0.0.1, default tiny model), one per mode:
- `slo`: priority + TTFT-deadline order, TPOT batch caps, admission control (predict TTFT, shed 503) and
  deadline-aware dropping of waiting requests that already missed their TTFT;
- `fcfs`: plain first-come-first-served (vLLM's default policy): arrival order, no priorities, every request
  admitted and served however late;
- `priority` (a stronger reference baseline): the route priorities, then arrival order, every request admitted.
Drives each with the load tester (`traces`, the `chat` mix from the Azure 2023 conversation trace) split over
an `interactive` route (tight SLO, high priority) and a `batch` route (loose SLO), and compares goodput
(requests meeting every SLO of their route per second; shed and failed requests are misses). Target: >= 1.5x
goodput vs FCFS at the knee (the first rate where FCFS attainment drops below 90%). Also reports the admission
predictor's error (predicted vs actual TTFT of admitted requests). Prints a table, writes
bench/results/slo.json and docs/img/slo_goodput.png (`--name` changes the stem).

    .venv/bin/python bench/slo.py [--rates 20,30,40,50,60,80] [--duration 10] [--modes slo,fcfs,priority]
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

from traces.loadtest import LoadTestConfig, run_once, sweep_point  # noqa: E402
from traces.metrics import Slo  # noqa: E402

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


def _point(rate: float, report: dict) -> dict:
    s = report["summary"]
    p = sweep_point(rate, report)
    return {
        "rate": rate, "offered_rps": round(p["offered_rate_rps"], 3), "sent": p["sent"],
        "completed": p["completed"], "shed": p["shed"], "failed": p["failed"],
        "goodput_rps": round(p["goodput_rps"] or 0.0, 3), "slo_attainment": round(p["slo_attainment"] or 0, 4),
        "throughput_rps": round(p["request_throughput_rps"], 3),
        "ttft_p99_ms": p["ttft_p99_ms"], "tpot_p99_ms": p["tpot_p99_ms"],
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


def knee(fcfs: list[dict]) -> float | None:
    """The first rate at which plain FCFS stops meeting the SLOs (attainment under 90%)."""
    for p in fcfs:
        if p["slo_attainment"] < 0.90:
            return p["rate"]
    return None


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
    knee_at = [p["offered_rps"] for p in results["modes"]["fcfs"] if p["rate"] == results["knee_rate"]]
    if knee_at:
        ax.axvline(knee_at[0], color="grey", ls=":", lw=1, label="knee (FCFS attainment < 90%)")
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
    parser.add_argument("--rates", default="20,30,40,50,60,80", help="offered rates, requests/s")
    parser.add_argument("--modes", default=",".join(MODES), help="which of slo,fcfs,priority to run")
    parser.add_argument("--name", default="slo", help="writes bench/results/NAME.json, docs/img/NAME_goodput.png")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals per rate")
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
        results["modes"] = run_modes(args.engine.resolve(), rates, args.duration, Path(tmp), modes)
    k = knee(results["modes"]["fcfs"])
    results["knee_rate"] = k
    ratios = {}
    for s, f in zip(results["modes"]["slo"], results["modes"]["fcfs"]):
        ratios[f"{s['rate']:g}"] = round(s["goodput_rps"] / f["goodput_rps"], 3) if f["goodput_rps"] else None
    results["goodput_ratio"] = ratios
    results["ratio_at_knee"] = ratios.get(f"{k:g}") if k is not None else None
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
          f"{'shed':>4} | {'fail':>4} | {'TTFT p99 ms':>11} | {'TPOT p99 ms':>11} | int. TTFT p99")
    for i, rate in enumerate(rates):
        for mode in modes:
            p = results["modes"][mode][i]
            inter = p["per_route"].get("interactive", {}).get("ttft_p99_ms")
            print(f"{rate:>5g} | {mode:>4} | {p['offered_rps']:>7.2f} | {p['goodput_rps']:>7.2f} | "
                  f"{p['slo_attainment']:>6.1%} | {p['completed']:>4} | {p['shed']:>4} | {p['failed']:>4} | "
                  f"{_num(p['ttft_p99_ms']):>11} | {_num(p['tpot_p99_ms']):>11} | {_num(inter)}")
    print(f"knee (FCFS attainment < 90%): {k} req/s; goodput ratio there: {results['ratio_at_knee']} "
          f"(target >= 1.5: {'met' if results['target_met'] else 'NOT met'}); ratios {ratios}")
    if "goodput_ratio_vs_priority" in results:
        print(f"SLO-aware vs priority FCFS: {results['goodput_ratio_vs_priority']}")
    print("admission decisions (route/action/reason: count):")
    for p in results["modes"]["slo"]:
        print(f"  rate {p['rate']:g}: {p.get('admission_decisions', {})}")
    print("admission TTFT prediction (admitted requests; error = actual - predicted):")
    for p in results["modes"]["slo"]:
        for key, e in p.get("ttft_prediction", {}).items():
            print(f"  rate {p['rate']:g} {key}: n={e['count']} mean error {e['mean_error_s'] * 1000:+.0f} ms, "
                  f"mean |error| {e['mean_abs_error_s'] * 1000:.0f} ms, within max(20%, 50 ms): "
                  f"{e['within_20pct']:.0%}, TTFT over target: {e['late']:.0%}")
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {results_path.relative_to(ROOT)} and {plot_path.relative_to(ROOT)} in {results['elapsed_s']} s")
    return 0


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


if __name__ == "__main__":
    raise SystemExit(main())
