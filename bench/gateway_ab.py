"""Gateway CPU per request before and after a change, the two trees measured in turn in one run (issue 41).

`--old COMMIT` is unpacked (git archive) into a temporary folder and given this tree's bench/gateway_overhead.py and loadgen,
so both trees serve the same harness. Then, in alternating rounds so the shared machine's load lands on both:
  - instant engine (bench/gateway_overhead.py's servers): server CPU per request of N sequential streamed and
    JSON chat completions on one keep-alive connection, for `gateway` (as `tandem serve` runs: no trace
    exporter), `traced` (every span handed to a BatchSpanProcessor), `untraced` (sampler always_off) and the
    bare uvicorn app `asgi`; added = gateway - asgi;
  - open loop at --rate req/s (Poisson, streamed; one client, the same arrivals for each server, gateway, asgi and
    bare back to back in each round): p50/p99 latency of the gateway minus the bare socket server's, and minus
    the bare uvicorn app's; each server's time per request on a CPU and runnable but waiting for one (schedstat:
    on a shared machine the tail is the second; bench/gateway_tail.py shows it request by request);
  - with --real: one-token completions (max_tokens 1, greedy) on the tiny small checkpoint through the real
    server (`gateway.server.main`, one route, one engine) against the same generation through the offline API
    (`engines.LLM`), server/process CPU per request, OMP_NUM_THREADS=1 for both; added = served - offline.
    Server CPU is the sum of its threads' time on a CPU (/proc/<pid>/task/*/schedstat, nanoseconds).
    Both /v1/completions and /v1/chat/completions (one user message; offline: the chat template rendered by
    the tokenizer, then `generate` of that text, as an offline caller would).

    .venv/bin/python bench/gateway_ab.py --old a9badfa [--requests 1000] [--rounds 3] [--real | --real-only]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway_overhead import _payload, _roundtrip, drive  # noqa: E402
from bench.results_meta import write_results  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "gateway_ab.json"
KINDS = ("asgi", "gateway", "traced", "untraced")
OPEN_LOOP = ("gateway", "asgi", "bare")  # the servers driven at --rate, in this order, one after the other
SERVER_ENV = {"untraced": {"OTEL_TRACES_SAMPLER": "always_off"}}
REAL_PROMPT = "Say hello to the benchmark."
ROUND_LOADS: dict[str, list[float]] = {"instant": [], "real": []}  # 1-minute load average after each tree's turn


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(proc: subprocess.Popen, port: int, path: bytes, what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                c.sendall(b"GET " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
                if c.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{what} did not start")


def start(tree: Path, kind: str) -> tuple[subprocess.Popen, int]:
    port = _port()
    env = {**os.environ, "PYTHONPATH": str(tree), **SERVER_ENV.get(kind, {})}
    proc = subprocess.Popen([sys.executable, str(tree / "bench" / "gateway_overhead.py"), "--serve", kind,
                             "--port", str(port)], cwd=tree, env=env)
    _wait(proc, port, b"/" if kind in ("asgi", "bare") else b"/ready", f"{tree.name} {kind}")
    return proc, port


def _schedstat(pid: int) -> tuple[float, float]:
    """Seconds a process's threads have spent so far on a CPU and runnable but waiting for one, in nanoseconds'
    resolution (/proc/<pid>/task/*/schedstat), not /proc/<pid>/stat's clock ticks (10 ms: 0.033 ms per request
    over 300 requests)."""
    on_cpu = waiting = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            continue
        on_cpu, waiting = on_cpu + int(fields[0]), waiting + int(fields[1])
    return on_cpu / 1e9, waiting / 1e9


def _cpu_seconds(pid: int) -> float:
    return _schedstat(pid)[0]


def sequential(proc: subprocess.Popen, port: int, payload: bytes, requests: int, warm: int = 200) -> float:
    """Server CPU ms per request of `requests` sequential round trips on one connection."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(warm):
            _roundtrip(conn, payload)
        cpu0 = _cpu_seconds(proc.pid)
        for _ in range(requests):
            _roundtrip(conn, payload)
        return 1000 * (_cpu_seconds(proc.pid) - cpu0) / requests


def instant(trees: dict[str, Path], requests: int, rounds: int, rate: float, duration: float) -> dict:
    servers = {(t, k): start(path, k) for t, path in trees.items() for k in KINDS}
    bare = {t: start(path, "bare") for t, path in trees.items()}
    cpu: dict[str, dict[str, dict[str, list[float]]]] = {t: {k: {"stream": [], "json": []} for k in KINDS}
                                                         for t in trees}
    lat: dict[str, dict[str, list[float]]] = {t: {w: [] for w in OPEN_LOOP} for t in trees}
    # per open-loop server: [seconds on a CPU, seconds runnable but waiting for a CPU, requests]
    sched: dict[str, dict[str, list[float]]] = {t: {w: [0.0, 0.0, 0] for w in OPEN_LOOP} for t in trees}
    lags: dict[str, dict[str, list[float]]] = {t: {w: [] for w in OPEN_LOOP} for t in trees}  # the client's
    p99s: dict[str, dict[str, list[float]]] = {t: {w: [] for w in OPEN_LOOP} for t in trees}  # each round's
    try:
        for r in range(rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for t in order:
                for k in KINDS:
                    proc, port = servers[(t, k)]
                    for mode in ("stream", "json"):
                        cpu[t][k][mode].append(sequential(proc, port, _payload(mode), requests))
                for which in OPEN_LOOP:
                    proc, port = bare[t] if which == "bare" else servers[(t, which)]
                    drive(port, "stream", 50, 0.5)  # warm the connections
                    cpu0, wait0 = _schedstat(proc.pid)
                    row = drive(port, "stream", rate, duration / rounds, seed=r)
                    cpu1, wait1 = _schedstat(proc.pid)
                    acc = sched[t][which]
                    acc[0], acc[1], acc[2] = acc[0] + cpu1 - cpu0, acc[1] + wait1 - wait0, acc[2] + row["requests"]
                    if row["errors"]:
                        print(f"  {t} {which}: {row['errors']} errors at {rate:g} req/s {row['error_sample']}")
                    lat[t][which] += row["latencies_s"]
                    lags[t][which].append(row["dispatch_lag_p99_ms"])
                    p99s[t][which].append(float(np.percentile(np.asarray(row["latencies_s"]) * 1000, 99)))
                ROUND_LOADS["instant"].append(os.getloadavg()[0])
                print(f"  round {r + 1}/{rounds} done; load average {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        for proc, _ in [*servers.values(), *bare.values()]:
            proc.terminate()
            proc.wait(10)
    out: dict = {}
    for t in trees:
        rows = {k: {mode: {"median": float(np.median(v)), "rounds": v} for mode, v in modes.items()}
                for k, modes in cpu[t].items()}
        added = {k: {mode: rows[k][mode]["median"] - rows["asgi"][mode]["median"] for mode in ("stream", "json")}
                 for k in ("gateway", "traced", "untraced")}
        pct = {w: {p: float(np.percentile(np.asarray(v) * 1000, p)) for p in (50, 99)} for w, v in lat[t].items()}
        out[t] = {"cpu_ms_per_request": rows, "added_cpu_ms_over_asgi": added,
                  f"latency_ms_at_{rate:g}": pct,
                  f"added_latency_ms_at_{rate:g}": {f"p{p}": pct["gateway"][p] - pct["bare"][p] for p in (50, 99)},
                  f"added_latency_ms_over_asgi_at_{rate:g}": {f"p{p}": pct["gateway"][p] - pct["asgi"][p]
                                                              for p in (50, 99)},
                  f"server_ms_per_request_at_{rate:g}": {
                      w: {"on_cpu": 1000 * a[0] / max(1, a[2]), "runnable_waiting": 1000 * a[1] / max(1, a[2])}
                      for w, a in sched[t].items()},
                  "client_dispatch_lag_p99_ms_rounds": lags[t], "p99_ms_rounds": p99s[t],
                  # the servers back to back in each round: their p99s paired by round, the median of the
                  # differences, which one burst of the shared machine's load in one slice does not move
                  f"added_p99_ms_at_{rate:g}_median_of_rounds": {
                      over: float(np.median(np.subtract(p99s[t]["gateway"], p99s[t][over])))
                      for over in ("bare", "asgi")},
                  "requests_at_rate": {w: len(v) for w, v in lat[t].items()}}
    return out


REAL_CONFIG = """
[server]
host = "127.0.0.1"
port = {port}
max_inflight_requests = 1024
log_level = "warning"
[kv_pool]
memory_bytes = "256MiB"
block_size = 16
enable_prefix_caching = true
[engines.small]
checkpoint = "{tree}/models/tandem-tiny-s"
max_num_seqs = 64
max_num_batched_tokens = 512
[routes.fast]
strategy = "fixed"
engines = ["small"]
"""

OFFLINE = """
import os, sys, time
from engines import LLM, SamplingParams
llm = LLM(sys.argv[1], memory_bytes=256 << 20)
params = SamplingParams(max_tokens=1, temperature=0.0)
n = int(sys.argv[2])
if sys.argv[4] == "chat":
    messages = [{"role": "user", "content": sys.argv[3]}]
    prompt = lambda: llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
else:
    prompt = lambda: sys.argv[3]
for _ in range(200):
    llm.generate(prompt(), params)
c0 = time.process_time()
for _ in range(n):
    out = llm.generate(prompt(), params)
assert len(out[0].outputs[0].token_ids) == 1
print((time.process_time() - c0) * 1000 / n)
"""


def real(trees: dict[str, Path], requests: int, rounds: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    payloads = {}
    for mode, path, fields in (("completion", b"/v1/completions", {"prompt": REAL_PROMPT}),
                               ("chat", b"/v1/chat/completions",
                                {"messages": [{"role": "user", "content": REAL_PROMPT}]})):
        body = json.dumps({"model": "fast", **fields, "max_tokens": 1, "temperature": 0}).encode()
        payloads[mode] = (b"POST " + path + b" HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n" % len(body)) + body
    servers = {}
    tmp = Path(tempfile.mkdtemp(prefix="gateway_ab_cfg_"))
    for t, tree in trees.items():
        port = _port()
        cfg = tmp / f"{t}.toml"
        cfg.write_text(REAL_CONFIG.format(port=port, tree=ROOT))
        proc = subprocess.Popen([sys.executable, "-c", "import sys; from gateway.server import main; "
                                 "sys.exit(main(sys.argv[1:]))", "--config", str(cfg)], cwd=tree,
                                env={**env, "PYTHONPATH": str(tree)})
        _wait(proc, port, b"/ready", f"{t} tandem serve")
        servers[t] = (proc, port)
    served = {t: {mode: [] for mode in payloads} for t in trees}
    offline = {t: {mode: [] for mode in payloads} for t in trees}
    try:
        for r in range(rounds):
            for t in (list(trees) if r % 2 == 0 else list(reversed(trees))):
                proc, port = servers[t]
                for mode, payload in payloads.items():
                    served[t][mode].append(sequential(proc, port, payload, requests))
                    ran = subprocess.run([sys.executable, "-c", OFFLINE, str(ROOT / "models" / "tandem-tiny-s"),
                                          str(requests), REAL_PROMPT, mode], cwd=trees[t],
                                         env={**env, "PYTHONPATH": str(trees[t])}, capture_output=True, text=True,
                                         check=True)
                    offline[t][mode].append(float(ran.stdout.strip().splitlines()[-1]))
            ROUND_LOADS["real"].append(os.getloadavg()[0])
            print(f"  real round {r + 1}/{rounds} done; load average {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    return {t: {mode: {"served_cpu_ms": float(np.median(served[t][mode])),
                       "offline_cpu_ms": float(np.median(offline[t][mode])),
                       "added_cpu_ms": float(np.median(served[t][mode]) - np.median(offline[t][mode])),
                       "served_rounds": served[t][mode], "offline_rounds": offline[t][mode]} for mode in payloads}
            for t in trees}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the commit to compare this tree with")
    ap.add_argument("--requests", type=int, default=1000, help="sequential requests per server, mode and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", type=float, default=1000.0, help="open-loop rate for the added latency")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds at --rate per server, over the rounds")
    ap.add_argument("--real", action="store_true", help="also one-token completions on the tiny small model")
    ap.add_argument("--real-requests", type=int, default=1000)
    ap.add_argument("--real-only", action="store_true", help="only the one-token completions (implies --real)")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the JSON goes")
    args = ap.parse_args(argv)
    old = Path(tempfile.mkdtemp(prefix="gateway_ab_old_"))
    try:
        archive = subprocess.run(["git", "archive", args.old], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        for harness in ("gateway_overhead.py", "loadgen.py", "loadgen.c"):
            shutil.copy(ROOT / "bench" / harness, old / "bench" / harness)
        trees = {"old": old, "new": ROOT}
        load0 = os.getloadavg()
        print(f"old {args.old} vs this tree; load average {load0[0]:.1f} on {os.cpu_count()} cores", flush=True)
        result = {"bench": "gateway_ab", "old_commit": args.old, "requests": args.requests, "rounds": args.rounds,
                  "rate": args.rate, "duration_s": args.duration, "load_average_start": load0}
        if not args.real_only:
            result["instant"] = instant(trees, args.requests, args.rounds, args.rate, args.duration)
        if args.real or args.real_only:
            result["real"] = real(trees, args.real_requests, args.rounds)
        result["load_average_end"] = os.getloadavg()
        result["load_average_rounds"] = ROUND_LOADS
    finally:
        shutil.rmtree(old, ignore_errors=True)
    for t in ("old", "new"):
        if "instant" not in result:
            print(f"{t}:")
        for mode, r in result.get("real", {}).get(t, {}).items() if "instant" not in result else ():
            print(f"  one-token {mode}: served {r['served_cpu_ms']:.3f} ms, offline {r['offline_cpu_ms']:.3f} ms, "
                  f"added {r['added_cpu_ms']:.3f} ms")
        if "instant" not in result:
            continue
        i = result["instant"][t]
        cpu = i["cpu_ms_per_request"]
        print(f"{t}: CPU ms/request (median of rounds), stream / json")
        for k in KINDS:
            extra = "" if k == "asgi" else (f"   added {i['added_cpu_ms_over_asgi'][k]['stream']:.3f} / "
                                            f"{i['added_cpu_ms_over_asgi'][k]['json']:.3f}")
            print(f"  {k:<9}{cpu[k]['stream']['median']:7.3f} / {cpu[k]['json']['median']:.3f}{extra}")
        a = i[f"added_latency_ms_at_{args.rate:g}"]
        u = i[f"added_latency_ms_over_asgi_at_{args.rate:g}"]
        m = i[f"added_p99_ms_at_{args.rate:g}_median_of_rounds"]
        print(f"  added latency at {args.rate:g} req/s (stream, gateway - bare): p50 {a['p50']:.2f} ms, "
              f"p99 {a['p99']:.2f} ms; gateway - asgi: p50 {u['p50']:.2f} ms, p99 {u['p99']:.2f} ms; p99 added, median "
              f"of the rounds' differences: over bare {m['bare']:.2f} ms, over asgi {m['asgi']:.2f} ms")
        for w, pct in i[f"latency_ms_at_{args.rate:g}"].items():
            sv = i[f"server_ms_per_request_at_{args.rate:g}"][w]
            print(f"    {w:<8} p50 {pct[50]:.2f} p99 {pct[99]:.2f} ms; server per request: on a CPU "
                  f"{sv['on_cpu']:.3f} ms, runnable but waiting for one {sv['runnable_waiting']:.3f} ms")
        for mode, r in result.get("real", {}).get(t, {}).items():
            print(f"  one-token {mode}: served {r['served_cpu_ms']:.3f} ms, offline {r['offline_cpu_ms']:.3f} ms, "
                  f"added {r['added_cpu_ms']:.3f} ms")
    print(f"load average at the end {result['load_average_end'][0]:.1f}")
    write_results(args.results, result, indent=1)
    print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
