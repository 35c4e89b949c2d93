"""Where a request's CPU goes in the gateway: py-spy samples a live `tandem` gateway (bench/gateway_overhead.py's
server over the instant fake engine) under steady sequential load (streamed and JSON chat completions in turn)
and each sample is charged to the stage of its innermost gateway-known frame; the table prints the shares and,
scaled by the server's measured CPU per request (/proc), the milliseconds per request of each stage.

    .venv/bin/python bench/gateway_profile.py [--seconds 20] [--rate 400] [--kind gateway|untraced]
    .venv/bin/python bench/gateway_profile.py --real [--seconds 15]   # the real server, per request kind

`--real` profiles `gateway.server.main` on the tiny small checkpoint (bench/gateway_ab.py's config, one engine,
OMP_NUM_THREADS=1) under one-token /v1/completions, one-token /v1/chat/completions and an 8-token streamed chat,
each alone for `--seconds`. py-spy samples only the thread holding the GIL there (`--gil`: idle waits and
uvloop's poll hold none); the event-loop thread's and the other threads' CPU per request come from
/proc/<pid>/task, and each is shared out over that thread's samples by stage.

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
    ("socket write", r"^(RequestResponseCycle\.send|_HeadHeld\.(write|flush)) \("),
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


REAL_RESULTS = ROOT / "bench" / "results" / "gateway_profile_real.json"
ENGINE_STEP = "engine step (model, scheduler, detokenising: offline too)"
HAND_BACK = "hand-off back to the loop (deliver)"
HAND_IN = "engine hand-off in (generate, wake, queue)"
INTAKE = "engine intake (add_request's checks: offline too)"


def real_stage(frames: list[str]) -> tuple[str, str]:
    """(thread, stage) of one sample of the real server: the engine thread's step or its hand-back, or the event
    loop's stages (the hand-off in and the engine's intake first, then the instant profile's table)."""
    if any(f.startswith("EngineCore._loop (") for f in frames):
        return "engine", HAND_BACK if any(f.startswith("OutputProcessor.deliver (") for f in frames) else ENGINE_STEP
    if any(f.startswith(("ModelEngine.add_request (", "ModelEngine.submit (")) for f in frames):
        return "loop", INTAKE
    if any(re.search(r"\(engines/async_engine\.py\)|^EngineCore\.wake \(|^Queue\.(get|put_nowait) \(", f)
           for f in frames):
        return "loop", HAND_IN
    return "loop", stage_of(frames)


def _thread_cpu_seconds(pid: int, tid: int) -> float:
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _real_payloads() -> dict[str, bytes]:
    import json

    def post(path: str, body: dict) -> bytes:
        raw = json.dumps({"model": "fast", "temperature": 0, **body}).encode()
        return (b"POST %s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n" % (path.encode(), len(raw))) + raw

    chat = [{"role": "user", "content": "Say hello to the benchmark."}]
    return {"completion": post("/v1/completions", {"prompt": "Say hello to the benchmark.", "max_tokens": 1}),
            "chat": post("/v1/chat/completions", {"messages": chat, "max_tokens": 1}),
            "stream8": post("/v1/chat/completions", {"messages": chat, "max_tokens": 8, "stream": True,
                                                     "stream_options": {"include_usage": True}})}


def real_main(args: argparse.Namespace) -> int:
    from bench.gateway_ab import REAL_CONFIG, _port, _wait

    port = _port()
    tmp = Path(tempfile.mkdtemp(prefix="gateway_profile_"))
    (tmp / "real.toml").write_text(REAL_CONFIG.format(port=port, tree=ROOT))
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from gateway.server import main; "
                             "sys.exit(main(sys.argv[1:]))", "--config", str(tmp / "real.toml")], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    result: dict = {"bench": "gateway_profile_real", "seconds": args.seconds, "rate": args.rate, "kinds": {}}
    try:
        _wait(proc, port, b"/ready", "tandem serve")
        for kind, payload in _real_payloads().items():
            stop, done = threading.Event(), [0]

            def drive_one(payload: bytes = payload, stop: threading.Event = stop, done: list = done) -> None:
                with socket.create_connection(("127.0.0.1", port)) as conn:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    while not stop.is_set():
                        _roundtrip(conn, payload)
                        done[0] += 1

            driver = threading.Thread(target=drive_one)
            driver.start()
            time.sleep(3.0)  # warm-up
            n0, cpu0, loop0 = done[0], _cpu_seconds(proc.pid), _thread_cpu_seconds(proc.pid, proc.pid)
            out = tmp / f"{kind}.txt"
            subprocess.run([str(Path(sys.executable).parent / "py-spy"), "record", "--gil", "--nonblocking", "-p",
                            str(proc.pid),
                            "-d", str(int(args.seconds)), "-r", str(args.rate), "-f", "raw", "-o", str(out)],
                           check=True, capture_output=True)
            n = done[0] - n0
            cpu, loop_cpu = _cpu_seconds(proc.pid) - cpu0, _thread_cpu_seconds(proc.pid, proc.pid) - loop0
            stop.set()
            driver.join()
            counts: collections.Counter = collections.Counter()
            for line in out.read_text().splitlines():
                stack, _, k = line.rpartition(" ")
                frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
                if frames and frames[-1].startswith("_worker (concurrent/futures/thread.py"):
                    continue
                counts[real_stage(frames)] += int(k)
            us = {"loop": 1e6 * loop_cpu / max(1, n), "engine": 1e6 * (cpu - loop_cpu) / max(1, n)}
            per_thread = {t: sum(v for (tt, _), v in counts.items() if tt == t) for t in us}
            total_us = us["loop"] + us["engine"]
            rows = {f"{t}: {stage}": {"us_per_request": us[t] * v / max(1, per_thread[t]),
                                      "share": us[t] * v / max(1, per_thread[t]) / max(1e-9, total_us)}
                    for (t, stage), v in sorted(counts.items(), key=lambda kv: -kv[1])}
            load = os.getloadavg()[0]
            result["kinds"][kind] = {"requests": n, "server_cpu_us_per_request": total_us,
                                     "loop_thread_cpu_us": us["loop"], "other_threads_cpu_us": us["engine"],
                                     "load_average": load, "samples": sum(counts.values()), "stages": rows}
            print(f"{kind}: {n} requests in {args.seconds:g} s, server CPU {total_us:.0f} us/request (event loop "
                  f"{us['loop']:.0f}, engine and other threads {us['engine']:.0f}); load average {load:.1f}")
            for name, row in rows.items():
                print(f"  {name:<66}{row['us_per_request']:8.1f} us {100 * row['share']:6.1f}%")
    finally:
        proc.terminate()
        proc.wait(30)
    write_results(REAL_RESULTS, result, indent=1)
    print(f"wrote {REAL_RESULTS.relative_to(ROOT)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rate", type=int, default=400, help="py-spy samples per second")
    ap.add_argument("--kind", default="gateway", choices=("gateway", "traced", "untraced"))
    ap.add_argument("--real", action="store_true", help="the real server on the tiny model, per request kind")
    args = ap.parse_args(argv)
    if args.real:
        return real_main(args)
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
