"""`tandem serve` as a real subprocess on a free port, for the tests that need the whole server process
(the CLI, signals, exporters, lm-eval): start it, wait until /ready, stop it."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def start_serve(args: Sequence[str], env: Mapping[str, str], port: int, timeout_s: float = 90) -> tuple[
        subprocess.Popen, str]:
    """`python -m gateway.cli serve *args` (args include `--port port`); returns (process, base url) once
    /ready answers 200. A server that exits or never gets ready fails the test with its output."""
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", *args], cwd=ROOT, env=dict(env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"tandem serve {' '.join(args)} never became ready: "
                                 f"{proc.communicate(timeout=10)[0]}")
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.communicate(timeout=60)
