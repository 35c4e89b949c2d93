"""Start-up of `tandem serve` to /ready (issue 37): the command a user runs, launched afresh each round, /ready
polled every 10 ms over one HTTP connection; wall seconds from the launch to the first 200, and the server's
own CPU seconds by then (/proc/<pid>/stat of the process and its threads).

    .venv/bin/python bench/startup.py [--rounds 7] [-- extra tandem serve arguments]

With no extra arguments it serves the embedded tiny pair, as `make serve` does.
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402
from bench.vs_llamacpp import free_port  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "startup.json"
TANDEM = ROOT / ".venv" / "bin" / "tandem"


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, all threads


def _ready(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        conn.request("GET", "/ready")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def one(extra: list[str], timeout: float = 120.0) -> dict:
    port = free_port()
    log = tempfile.TemporaryFile("w+")  # the server's log: a pipe nobody reads could fill and stall it
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(TANDEM), "serve", "--port", str(port), *extra], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=log, text=True)
    try:
        while not _ready(port):
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"tandem serve exited with {proc.returncode}: {log.read()[-2000:]}")
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"not ready within {timeout} s")
            time.sleep(0.01)
        wall = time.perf_counter() - t0
        cpu = _cpu_seconds(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    return {"wall_s": wall, "cpu_s": cpu}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        extra, argv = argv[argv.index("--") + 1:], argv[:argv.index("--")]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    one(extra)  # the first start after an install writes bytecode caches and builds the C helpers
    runs = []
    for i in range(args.rounds):
        runs.append(one(extra))
        print(f"round {i + 1}/{args.rounds}: ready after {runs[-1]['wall_s']:.3f} s, "
              f"{runs[-1]['cpu_s']:.2f} CPU s; load average {os.getloadavg()[0]:.2f}")
    walls = sorted(r["wall_s"] for r in runs)
    summary = {"median_wall_s": statistics.median(walls), "min_wall_s": walls[0], "max_wall_s": walls[-1],
               "median_cpu_s": statistics.median(r["cpu_s"] for r in runs)}
    print(f"tandem serve {' '.join(extra) or '(the embedded tiny pair)'}: to /ready median "
          f"{summary['median_wall_s']:.3f} s (min {walls[0]:.3f}, max {walls[-1]:.3f}), "
          f"server CPU {summary['median_cpu_s']:.2f} s")
    write_results(args.out, {"command": ["tandem", "serve", *extra], "rounds": runs, **summary,
                             "load_average_end": os.getloadavg()[0]})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
