"""`tandem serve` as a user runs it: a subprocess from a TOML file; bad configs fail fast with a worded error;
SIGTERM drains in-flight streams before a clean exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from gateway.server import free_port

ROOT = Path(__file__).resolve().parents[2]


def _serve(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})


def test_bad_config_fails_at_start_up_naming_the_field(tmp_path: Path):
    config = tmp_path / "bad.toml"
    config.write_text('[engines.m]\ncheckpoint = "nowhere"\ndtype = "float8"\n')
    proc = _serve(["--config", str(config)])
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "engines.m.dtype = 'float8' is invalid: expected one of 'auto', 'bfloat16', 'float16', 'float32'" in out
    config.write_text('[engines.m]\ncheckpoint = "nowhere"\n')
    proc = _serve(["--config", str(config)])
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "engines.m.checkpoint" in out and "does not exist" in out


@pytest.mark.slow
def test_sigterm_finishes_in_flight_streams_then_exits_cleanly(tiny_checkpoint, tmp_path: Path):
    ckpt = tiny_checkpoint("llama")
    port = free_port()
    config = tmp_path / "tandem.toml"
    config.write_text(f'[engines.tiny]\ncheckpoint = "{ckpt}"\n[kv_pool]\nmemory_bytes = "64MiB"\n'
                      f'[server]\ngrace_period_s = 60\n')
    proc = _serve(["--config", str(config), "--port", str(port)], env={"TANDEM_LOG_LEVEL": "info"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise AssertionError("server never became ready")
        started = threading.Barrier(5)
        results: list[dict] = []

        def stream() -> None:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 200, "n": 4, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                lines = r.iter_lines()
                first = next(lines)
                started.wait()
                rest = [line for line in lines if line]
            usage = json.loads(rest[-2][6:])["usage"]
            results.append({"first": first, "last": rest[-1], "usage": usage})

        threads = [threading.Thread(target=stream) for _ in range(4)]
        for t in threads:
            t.start()
        started.wait(timeout=60)  # every stream has its first chunk: all four are in flight
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=120)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(results) == 4
    for r in results:
        assert r["first"].startswith("data: {") and r["last"] == "data: [DONE]"
        assert r["usage"]["completion_tokens"] == 4 * 200  # every choice ran to max_tokens: nothing cut off
    assert proc.returncode == 0, out
    assert "Waiting for connections to close" in out
