"""Helper of bench/compare_strategies.sh: writes the per-variant server configs (each derived from
gateway/default.toml, differing in one knob) and folds the load-test reports into one table, JSON and plots.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TOML = ROOT / "gateway" / "default.toml"

# name -> (what differs from gateway/default.toml, keep the router-backed `auto` route?)
CONFIGS: dict[str, tuple[str, bool]] = {
    "baseline": ("default minus the `auto` route (runs without the router artifact)", False),
    "auto": ("default as shipped (all four routes; needs models/router)", True),
    "large_nospec": ("baseline with speculation off for the large model (no draft, k=0)", False),
    "large_noprefix": ("baseline with prefix caching off in the shared KV pool", False),
    "large_w8draft": ("baseline with the large model drafted by a draft-only w8a8 copy of the small model", False),
}


def _drop_table(text: str, header: str) -> str:
    """Remove one `[table]` and its lines up to the next table header (comments above it stay harmless)."""
    pattern = re.compile(rf"^\[{re.escape(header)}\]\n(?:(?!\[).*\n|\n)*", re.MULTILINE)
    out, n = pattern.subn("", text)
    if n != 1:
        raise SystemExit(f"gateway/default.toml: expected one [{header}] table, found {n}")
    return out


def _replace_line(text: str, old: str, new: str) -> str:
    pattern = re.compile(rf"^{re.escape(old)}$", re.MULTILINE)
    out, n = pattern.subn(new, text)
    if n != 1:
        raise SystemExit(f"gateway/default.toml: expected the line {old!r} once, found {n}")
    return out


def render_config(name: str, default_text: str, price_per_hour: float, slo: tuple[float, float]) -> str:
    """The TOML of one variant; paths re-rooted from the project root to bench/configs/. Every variant also
    gets a device price, so the server's own busy-time cost per 1,000 tokens can be read from /v1/routes, and
    one SLO on every route (the shipped routes differ: fast 500 ms TTFT, best 2000 ms), so admission control
    sheds by the same target on every variant and goodput compares."""
    text = re.sub(r'= "models/', '= "../../models/', default_text)
    if not CONFIGS[name][1]:
        text = _drop_table(text, "routes.auto")
    if name == "large_nospec":
        text = _replace_line(text, 'draft = "tandem-small"', "# compare_strategies: no draft, speculation off")
        text = _replace_line(text, "num_speculative_tokens = 4", "num_speculative_tokens = 0")
    elif name == "large_noprefix":
        text = _replace_line(text, "enable_prefix_caching = true", "enable_prefix_caching = false")
    elif name == "large_w8draft":
        text = _replace_line(text, 'draft = "tandem-small"', 'draft = "tandem-small-draft"')
        text = text.replace("[engines.tandem-large]", '[engines.tandem-small-draft]\ncheckpoint = "../../models/'
                            'tandem-tiny-s"\nserved = false\nquantization = "w8a8"\n\n[engines.tandem-large]', 1)
    slo_line = f"slo = {{ ttft_ms = {slo[0]:g}, tpot_ms = {slo[1]:g}, percentile = 99 }}"
    text, n = re.subn(r"^slo = \{.*\}$", slo_line, text, flags=re.MULTILINE)
    if n < 3:
        raise SystemExit(f"gateway/default.toml: expected an slo line per route, found {n}")
    text = text.rstrip("\n") + f"\n\n[cost]\nprice_per_device_hour = {price_per_hour}\n"
    head = (f"# bench/compare_strategies.py variant `{name}`: {CONFIGS[name][0]}.\n"
            "# Generated from gateway/default.toml by `python bench/compare_strategies.py configs`; do not edit.\n")
    return head + text


def write_configs(out_dir: Path, price_per_hour: float, slo: tuple[float, float]) -> list[Path]:
    from gateway.config import load_config  # validates every variant exactly as `tandem serve` will

    default_text = DEFAULT_TOML.read_text()
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (_, needs_router) in CONFIGS.items():
        path = out_dir / f"{name}.toml"
        path.write_text(render_config(name, default_text, price_per_hour, slo))
        tomllib.loads(path.read_text())
        if not needs_router or (ROOT / "models" / "router").is_dir():
            load_config(path)
        written.append(path)
    return written


def _pct(summary: dict[str, Any], metric: str, q: str) -> float | None:
    value = summary["overall"][metric].get(q) if summary["overall"].get(metric) else None
    return None if value is None else float(value)


def server_cost(routes: dict[str, Any] | None, route: str) -> float | None:
    """The gateway's own cost per 1,000 (prompt + completion) tokens for the route, from GET /v1/routes:
    each engine's busy (stepping) seconds times the price, shared among the tokens it finished."""
    for entry in (routes or {}).get("data", []):
        if entry.get("name") == route and entry.get("attainment"):
            return entry["attainment"].get("cost_per_1k_tokens")
    return None


def run_row(variant: str, config: str, route: str, report: dict[str, Any],
            routes: dict[str, Any] | None = None) -> dict[str, Any]:
    """One table row from one `tandem loadtest` report.json (and the server's /v1/routes at the end)."""
    s, meta, server = report["summary"], report["metadata"], report.get("server_metrics") or {}
    return {
        "variant": variant, "config": config, "route": route,
        "rate_rps": meta["rate"], "offered_rps": s["offered_rate_rps"],
        "sent": s["requests"]["sent"], "completed": s["requests"]["completed"],
        "failed": s["requests"]["failed"], "shed": s["requests"]["shed"],
        "ttft_p50_ms": _pct(s, "ttft_ms", "p50"), "ttft_p99_ms": _pct(s, "ttft_ms", "p99"),
        "tpot_p50_ms": _pct(s, "tpot_ms", "p50"), "tpot_p99_ms": _pct(s, "tpot_ms", "p99"),
        "output_tok_s": s["output_token_throughput_tps"],
        "slo_attainment": s["slo_attainment"], "goodput_rps": s["goodput_rps"],
        "usd_per_1k_output_tokens": s["cost"]["usd_per_1k_output_tokens"] if s.get("cost") else None,
        "server_usd_per_1k_tokens": server_cost(routes, route),
        "routing_split": s["routing_split"], "escalation_rate": s["escalation_rate"],
        "prefix_cache_hit_rate": server.get("prefix_cache_hit_rate"),
        "spec_acceptance_rate": server.get("spec_acceptance_rate"),
        "prompt_seed": meta["prompt_seed"], "seed": meta["seed"],
        "length_scale": meta["scaling"]["factor"] if meta.get("scaling") else None,
        "warnings": meta["warnings"],
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _split(split: dict[str, float]) -> str:
    short = {"tandem-small": "S", "tandem-large": "L"}
    return " / ".join(f"{short.get(k, k)} {v * 100:.0f}%" for k, v in sorted(split.items())) or "-"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| variant | route | workload | rate req/s | done/sent | TTFT p50 / p99 ms | TPOT p50 / p99 ms | SLO met | "
             "goodput req/s | $/1k out tok (window) | $/1k tok (busy) | split (S/L) | escalated | prefix hits | spec accept |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        esc = "-" if r["escalation_rate"] is None else f"{r['escalation_rate'] * 100:.0f}%"
        pfx = "-" if r["prefix_cache_hit_rate"] is None else f"{r['prefix_cache_hit_rate'] * 100:.0f}%"
        acc = "-" if r["spec_acceptance_rate"] is None else f"{r['spec_acceptance_rate'] * 100:.0f}%"
        lines.append(
            f"| {r['variant']} | {r['route']} | {r['workload']} | {r['rate_rps']:g} | {r['completed']}/{r['sent']} | "
            f"{_fmt(r['ttft_p50_ms'], '.0f')} / {_fmt(r['ttft_p99_ms'], '.0f')} | "
            f"{_fmt(r['tpot_p50_ms'], '.1f')} / {_fmt(r['tpot_p99_ms'], '.1f')} | "
            f"{r['slo_attainment'] * 100:.1f}% | {r['goodput_rps']:.2f} | "
            f"{_fmt(r['usd_per_1k_output_tokens'], '.6f')} | {_fmt(r.get('server_usd_per_1k_tokens'), '.6f')} | "
            f"{_split(r['routing_split'])} | {esc} | {pfx} | {acc} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], reports: dict[str, dict[str, Any]], img_dir: Path) -> list[Path]:
    """Bars of p50/p99 TTFT and TPOT and goodput per variant and rate; TTFT/TPOT CDFs at the highest rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    rates = sorted({r["rate_rps"] for r in rows})
    by = {(r["variant"], r["rate_rps"]): r for r in rows}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / max(1, len(rates))
    panels = [("TTFT ms (bar p50, tick p99)", "ttft_p50_ms", "ttft_p99_ms"),
              ("TPOT ms (bar p50, tick p99)", "tpot_p50_ms", "tpot_p99_ms"),
              ("goodput req/s (bar) vs offered (tick)", "goodput_rps", "offered_rps")]
    for ax, (title, low, high) in zip(axes, panels):
        for j, rate in enumerate(rates):
            xs, lows, highs = [], [], []
            for i, v in enumerate(variants):
                r = by.get((v, rate))
                if r is None or r[low] is None:
                    continue
                xs.append(i + (j - (len(rates) - 1) / 2) * width)
                lows.append(r[low])
                highs.append(r[high])
            ax.bar(xs, lows, width * 0.9, label=f"{rate:g} req/s")
            ax.scatter(xs, highs, marker="_", s=200, color="black", zorder=3)
        ax.set_xticks(range(len(variants)), variants, rotation=30, ha="right")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle("tandem strategies, chat workload (*_mt: long_context_multiturn); tiny models, 2 shared CPU cores")
    fig.tight_layout()
    bars = img_dir / "compare_strategies.png"
    fig.savefig(bars, dpi=110)
    plt.close(fig)

    top = max(rates)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, report in reports.items():
        variant, rate = key
        if rate != top:
            continue
        done = [rec for rec in report["records"] if rec["outcome"] == "completed"]
        for ax, field in zip(axes, ("ttft_s", "tpot_s")):
            values = sorted(rec[field] * 1000 for rec in done if rec.get(field) is not None)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=variant)
    for ax, name in zip(axes, ("TTFT ms", "TPOT ms")):
        ax.set_xscale("log")
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"latency CDFs at {top:g} req/s (all requests sent, warm-up included)")
    fig.tight_layout()
    cdf = img_dir / "compare_strategies_cdf.png"
    fig.savefig(cdf, dpi=110)
    plt.close(fig)
    return [bars, cdf]


def build_table(runs_dir: Path, plan: list[str], out_json: Path, img_dir: Path | None,
                extra: dict[str, Any]) -> str:
    rows, reports, skipped = [], {}, []
    for item in plan:
        variant, config, route, workload, rate = item.split(":")
        report_path = runs_dir / f"{variant}_r{rate}" / "report.json"
        if not report_path.is_file():
            reason_file = runs_dir / f"{variant}_r{rate}.skipped"
            reason = reason_file.read_text().strip() if reason_file.is_file() else f"no {report_path}"
            skipped.append({"variant": variant, "rate": float(rate), "reason": reason})
            continue
        report = json.loads(report_path.read_text())
        routes_path = report_path.parent / "routes.json"
        routes = json.loads(routes_path.read_text()) if routes_path.is_file() else None
        rows.append({"workload": workload, **run_row(variant, config, route, report, routes)})
        reports[(variant, float(report["metadata"]["rate"]))] = report
    table = markdown_table(rows)
    plots = [_show(p) for p in plot(rows, reports, img_dir)] if img_dir and rows else []
    from bench.results_meta import write_results

    write_results(out_json, {**extra, "rows": rows, "skipped": skipped, "plots": plots,
                                    "table_md": table}, indent=2)
    notes = [f"- skipped {s['variant']} at {s['rate']:g} req/s: {s['reason']}" for s in skipped]
    return "\n".join([table, *notes])


def _parse_slo(text: str) -> tuple[float, float]:
    parts = dict(item.split("=", 1) for item in text.split(","))
    return float(parts["ttft"]), float(parts["tpot"])


def _show(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("configs", help="write bench/configs/*.toml from gateway/default.toml")
    c.add_argument("--out", type=Path, default=ROOT / "bench" / "configs")
    c.add_argument("--price-per-hour", type=float, default=0.10, help="USD per device-hour, as [cost]")
    c.add_argument("--slo", default="ttft=1000,tpot=100", help="every route's SLO: ttft=MS,tpot=MS")
    t = sub.add_parser("table", help="fold the run reports into one table, JSON and plots")
    t.add_argument("--runs", type=Path, required=True)
    t.add_argument("--plan", nargs="+", required=True, help="VARIANT:CONFIG:ROUTE:WORKLOAD:RATE, in table order")
    t.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "compare_strategies.json")
    t.add_argument("--img-dir", type=Path, default=None)
    t.add_argument("--meta", default="{}", help="JSON object stored with the rows (command, machine, ...)")
    args = parser.parse_args(argv)
    if args.cmd == "configs":
        for path in write_configs(args.out, args.price_per_hour, _parse_slo(args.slo)):
            print(_show(path))
        return 0
    print(build_table(args.runs, args.plan, args.json, args.img_dir, json.loads(args.meta)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
