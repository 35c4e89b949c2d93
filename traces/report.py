"""Load-test reports: JSON (metadata, summary, server metrics, every raw request record), a Markdown summary,
and PNG plots (latency CDFs per route, latency percentiles over time, queue depth and KV usage, goodput vs
offered load). matplotlib is optional: without it the plots are skipped with a message saying so.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from traces.client import RequestRecord
from traces.metrics import route_of


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")


def _ms(v: float | None) -> str:
    return "-" if v is None else (f"{v:.1f}" if v < 1000 else f"{v:,.0f}")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def markdown_summary(report: dict[str, Any]) -> str:
    """A human summary of one run's report (the dict written to report.json)."""
    meta, s, srv = report["metadata"], report["summary"], report.get("server_metrics") or {}
    lines = [f"# Load test: {meta['source']} at {meta['rate_label']}", ""]
    lines += [f"- endpoint `{meta['url']}` ({meta['api']} API), models {', '.join(meta['models'])}",
              f"- arrivals: {meta['arrivals']}; measured window {s['window_s'][0]:.1f}-{s['window_s'][1]:.1f} s "
              f"(warm-up and cool-down excluded)",
              f"- lengths: {meta['lengths']}"]
    for w in meta.get("warnings", []):
        lines.append(f"- **warning**: {w}")
    req = s["requests"]
    goodput = f"{s['goodput_rps']:.2f}" if "goodput_rps" in s else "-"
    lines += ["", "| sent | completed | failed | shed | offered req/s | req/s | output tok/s | SLO attainment "
              "| goodput req/s |", "|---|---|---|---|---|---|---|---|---|",
              f"| {req['sent']} | {req['completed']} | {req['failed']} | {req['shed']} | "
              f"{s['offered_rate_rps']:.2f} | {s['request_throughput_rps']:.2f} | "
              f"{s['output_token_throughput_tps']:.1f} | {_pct(s.get('slo_attainment'))} | {goodput} |"]
    lines += ["", "Latency in ms (completed requests):", "",
              "| route | metric | p50 | p90 | p95 | p99 | p99.9 | max | n |", "|---|---|---|---|---|---|---|---|---|"]
    groups = [("all", s["overall"])] + [(r, e) for r, e in s["per_route"].items()]
    for name, entry in groups:
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            st = entry[metric]
            lines.append(f"| {name} | {metric[:-3].upper()} | " + " | ".join(
                _ms(st[k]) for k in ("p50", "p90", "p95", "p99", "p99.9", "max")) + f" | {st['count']} |")
    slo_rows = [(r, e["slo"]) for r, e in s["per_route"].items() if "slo" in e]
    if slo_rows:
        lines += ["", "| route | SLO | attainment per dimension | combined |", "|---|---|---|---|"]
        for r, slo in slo_rows:
            limits = ", ".join(f"{k[:-3]} {v:g} ms" for k, v in slo.items() if k.endswith("_ms"))
            att = slo["attainment"]
            dims = ", ".join(f"{k} {_pct(v)}" for k, v in att.items() if k != "combined")
            lines.append(f"| {r} | {limits} | {dims} | {_pct(att['combined'])} |")
    lines += [""]
    if s.get("routing_split"):
        lines.append("- routing split: " + ", ".join(f"{m} {_pct(v)}" for m, v in s["routing_split"].items()))
    if s.get("escalation_rate") is not None:
        lines.append(f"- escalation rate: {_pct(s['escalation_rate'])}")
    if srv.get("available"):
        lines.append(f"- server: prefix-cache hit rate {_pct(srv.get('prefix_cache_hit_rate'))}, speculative "
                     f"acceptance {_pct(srv.get('spec_acceptance_rate'))}, max waiting {srv.get('max_waiting')}, "
                     f"max KV usage {_pct(srv.get('max_kv_usage'))}, mean queue time "
                     f"{_ms(None if srv.get('server_mean_queue_s') is None else 1000 * srv['server_mean_queue_s'])} ms")
    else:
        lines.append(f"- server metrics: not available ({srv.get('reason')})")
    if s.get("cost"):
        c = s["cost"]
        per = c["usd_per_1k_output_tokens"]
        lines.append(f"- cost at ${c['price_per_hour_usd']:g}/device-hour: "
                     f"${per:.6f} per 1,000 output tokens" if per is not None else "- cost: no output tokens")
    return "\n".join(lines) + "\n"


def sweep_markdown(sweep: dict[str, Any]) -> str:
    lines = [f"# Rate sweep: {sweep['source']}", "",
             "| rate req/s | sent | completed | failed | shed | SLO attainment | goodput req/s | TTFT p50 | TTFT p99 "
             "| TPOT p50 | TPOT p99 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in sweep["points"]:
        lines.append(f"| {p['rate']:g} | {p['sent']} | {p['completed']} | {p['failed']} | {p['shed']} | "
                     f"{_pct(p.get('slo_attainment'))} | {p.get('goodput_rps', 0) or 0:.2f} | {_ms(p['ttft_p50_ms'])} | "
                     f"{_ms(p['ttft_p99_ms'])} | {_ms(p['tpot_p50_ms'])} | {_ms(p['tpot_p99_ms'])} |")
    lines += ["", f"- highest rate meeting the SLOs at 90% attainment: {sweep['max_rate_at_90'] or 'none'}",
              f"- highest rate meeting the SLOs at 99% attainment: {sweep['max_rate_at_99'] or 'none'}"]
    return "\n".join(lines) + "\n"


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


PLOTS_UNAVAILABLE = "matplotlib is not installed: plots skipped (pip install matplotlib, or the [test] extra)"


def plot_run(out: Path, records: list[RequestRecord], server: dict[str, Any] | None) -> list[str] | str:
    """Write the per-run PNGs; returns their names, or a message when plotting is unavailable."""
    plt = _pyplot()
    if plt is None:
        return PLOTS_UNAVAILABLE
    done = [r for r in records if r.outcome == "completed"]
    written = []
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (label, get) in zip(axes, (("TTFT", lambda r: r.ttft_s), ("TPOT", lambda r: r.tpot_s),
                                       ("E2E", lambda r: r.e2e_s))):
        for route in sorted({route_of(r) for r in done}):
            vals = np.sort([get(r) * 1000 for r in done if route_of(r) == route and get(r) is not None])
            if vals.size:
                ax.step(vals, np.arange(1, vals.size + 1) / vals.size, where="post", label=route)
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Latency CDFs per route")
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=110)
    plt.close(fig)
    written.append("latency_cdf.png")

    if done:
        end = max(r.sent_s for r in done) + 1e-9
        width = max(1.0, end / 30)
        bins = np.arange(0, end + width, width)
        fig, ax = plt.subplots(figsize=(8, 3.8))
        for label, get in (("TTFT", lambda r: r.ttft_s), ("TPOT", lambda r: r.tpot_s)):
            for q, style in ((50, "-"), (99, "--")):
                xs, ys = [], []
                for a, b in zip(bins, bins[1:]):
                    vals = [get(r) * 1000 for r in done if a <= r.sent_s < b and get(r) is not None]
                    if vals:
                        xs.append((a + b) / 2)
                        ys.append(np.percentile(vals, q))
                ax.plot(xs, ys, style, label=f"{label} p{q}")
        ax.set_yscale("log")
        ax.set_xlabel("send time (s)")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        ax.set_title(f"Latency percentiles over time ({width:.1f} s buckets)")
        fig.tight_layout()
        fig.savefig(out / "latency_timeseries.png", dpi=110)
        plt.close(fig)
        written.append("latency_timeseries.png")

    series = (server or {}).get("series") or []
    if len(series) >= 2:
        fig, ax = plt.subplots(figsize=(8, 3.8))
        t = [s["t_s"] for s in series]
        for key in ("waiting", "running"):
            ax.plot(t, [s.get(key, math.nan) for s in series], label=f"requests {key}")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("requests")
        ax2 = ax.twinx()
        ax2.plot(t, [100 * s.get("kv_usage", math.nan) for s in series], "k:", label="KV usage %")
        ax2.set_ylabel("KV usage (%)")
        ax2.set_ylim(0, 100)
        lines = ax.get_legend_handles_labels()
        lines2 = ax2.get_legend_handles_labels()
        ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="upper left")
        ax.grid(alpha=0.3)
        ax.set_title("Server queue depth and KV usage (/metrics)")
        fig.tight_layout()
        fig.savefig(out / "server_timeseries.png", dpi=110)
        plt.close(fig)
        written.append("server_timeseries.png")
    return written


def plot_sweep(out: Path, points: list[dict[str, Any]]) -> list[str] | str:
    plt = _pyplot()
    if plt is None:
        return PLOTS_UNAVAILABLE
    rates = [p["rate"] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(rates, [p["offered_rate_rps"] for p in points], ":", color="grey", label="offered (measured)")
    ax.plot(rates, [p["request_throughput_rps"] for p in points], "o-", label="throughput")
    ax.plot(rates, [p.get("goodput_rps") or 0 for p in points], "s-", label="goodput (all SLOs met)")
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("req/s")
    ax2 = ax.twinx()
    ax2.plot(rates, [100 * (p.get("slo_attainment") or 0) for p in points], "k--", alpha=0.5, label="attainment %")
    ax2.set_ylim(0, 105)
    ax2.set_ylabel("SLO attainment (%)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    ax.set_title("Goodput vs offered load")
    fig.tight_layout()
    fig.savefig(out / "goodput.png", dpi=110)
    plt.close(fig)
    return ["goodput.png"]
