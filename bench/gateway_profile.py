"""Where a request's CPU goes in the gateway: py-spy samples a live `tandem` gateway (bench/gateway_overhead.py's
server over the instant fake engine) under steady sequential load (streamed and JSON chat completions in turn)
and each sample is charged to the stage of its innermost gateway-known frame; the table prints the shares and,
scaled by the server's measured CPU per request (/proc), the milliseconds per request of each stage.

    .venv/bin/python bench/gateway_profile.py [--seconds 20] [--rate 400] [--kind gateway|untraced]

py-spy samples wall time of running threads: a write to the loopback socket wakes the client, which on a
loaded machine may take the core, so the `socket write` row is wall time, not CPU; it is reported apart and
the per-request milliseconds share out only the CPU the other rows account for.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway_overhead import _cpu_seconds, _payload, _roundtrip, start_server  # noqa: E402
from bench.results_meta import write_results  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "gateway_profile.json"

# (stage, pattern on "function (file)"): the innermost frame that matches one decides a sample's stage
STAGES: list[tuple[str, str]] = [
    ("socket write", r"^RequestResponseCycle\.send \("),
    ("metrics + spans", r"\((gateway/(tracing|telemetry|metrics|vllm_metrics|slo)\.py|opentelemetry/|"
                        r"(trace|attributes|sdk|context|propagate|util)/|prometheus_client/)"),
    ("formatting (JSON)", r"\((gateway/(openai_format|answers)\.py|msgspec/)|^encode \("),
    ("SSE", r"\(gateway/streaming\.py\)|^_stream_events \(|^_EventStreamResponse"),
    ("engine hand-off and back", r"\((gateway_overhead\.py|engines/|gateway/routing\.py)\)|^_first_output \("),
    ("admission + limits", r"\(gateway/(admission|limits|auth)\.py\)|^_admit \("),
    ("rendering + tokenising", r"\(gateway/(prompts|tokenize_pool)\.py\)"),
    ("routing", r"\(gateway/(routes|router_strategy|cascade)\.py\)|^resolve_route \(|^_answered_by \("),
    ("decode + validation", r"\((gateway/(strict_request|protocol)\.py|litestar/_kwargs/)|^sampling_params \("),
    ("pipeline glue", r"\(gateway/(lifecycle|pipeline|accounting|app|completions)\.py\)"),
    ("HTTP + ASGI", r"\((uvicorn/|litestar/|gateway/(server|http_guard|fast_path)\.py|asyncio/|httptools)"),
]
_COMPILED = [(name, re.compile(pattern)) for name, pattern in STAGES]


def stage_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, pattern in _COMPILED:
            if pattern.search(frame):
                return name
    return "other"


def classify(raw: str) -> collections.Counter:
    """Samples per stage from py-spy's raw (collapsed) output; the worker threads' idle waits are left out."""
    counts: collections.Counter = collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        if frames and frames[-1].startswith("_worker (concurrent/futures/thread.py"):
            continue  # a pool thread parked on its queue (py-spy cannot always tell it is idle)
        counts[stage_of(frames)] += int(n)
    return counts


def drive(port: int, stop: threading.Event, done: list[int]) -> None:
    payloads = [_payload("stream"), _payload("json")]
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while not stop.is_set():
            for p in payloads:
                _roundtrip(conn, p)
            done[0] += 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rate", type=int, default=400, help="py-spy samples per second")
    ap.add_argument("--kind", default="gateway", choices=("gateway", "traced", "untraced"))
    args = ap.parse_args(argv)
    proc, port = start_server(args.kind)
    stop, done = threading.Event(), [0]
    try:
        warm = threading.Thread(target=drive, args=(port, stop, done))
        warm.start()
        time.sleep(3.0)  # warm-up: first-request paths
        n0, cpu0 = done[0], _cpu_seconds(proc.pid)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "raw.txt"
            subprocess.run([str(Path(sys.executable).parent / "py-spy"), "record", "--nonblocking", "-p", str(proc.pid), "-d",
                            str(int(args.seconds)), "-r", str(args.rate), "-f", "raw", "-o", str(out)],
                           check=True, capture_output=True)
            raw = out.read_text()
        requests, cpu_s = done[0] - n0, _cpu_seconds(proc.pid) - cpu0
        stop.set()
        warm.join()
    finally:
        stop.set()
        proc.terminate()
        proc.wait(10)
    counts = classify(raw)
    cpu_ms = 1000 * cpu_s / max(1, requests)
    cpu_samples = sum(v for k, v in counts.items() if k != "socket write")
    total = sum(counts.values())
    print(f"{args.kind}: {requests} requests (stream and JSON alternating) in {args.seconds:g} s, server CPU "
          f"{cpu_ms:.3f} ms/request; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'stage':<28}{'samples %':>10}{'ms/request':>12}")
    rows = {}
    for name, _ in [*STAGES, ("other", "")]:
        share = counts.get(name, 0) / max(1, total)
        ms = None if name == "socket write" else cpu_ms * counts.get(name, 0) / max(1, cpu_samples)
        rows[name] = {"samples_share": share, "ms_per_request": ms}
        print(f"{name:<28}{100 * share:>9.1f}%{'(wall)' if ms is None else f'{ms:.3f}':>12}")
    write_results(RESULTS, {"bench": "gateway_profile", "kind": args.kind, "seconds": args.seconds,
                            "requests": requests, "server_cpu_ms_per_request": cpu_ms,
                            "load_average": os.getloadavg(), "stages": rows}, indent=1)
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
