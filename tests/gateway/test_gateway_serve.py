"""`tandem serve` as a user runs it: a subprocess from a TOML file; bad configs fail fast with a worded error;
SIGTERM drains: in-flight streams finish, new requests get 503 + Retry-After, streams still running at the end
of the grace period end with an error event and [DONE], and the process exits 0 without a traceback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from tiny_checkpoints import with_chat_template  # noqa: E402  (conftest puts tests/ on the path)

from gateway.server import free_port

ROOT = Path(__file__).resolve().parents[2]


def _serve(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})


def _serve_ready(ckpt: Path, tmp_path: Path, grace_period_s: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config = tmp_path / "tandem.toml"
    config.write_text(f'[engines.tiny]\ncheckpoint = "{ckpt}"\n[kv_pool]\nmemory_bytes = "64MiB"\n'
                      f'[server]\ngrace_period_s = {grace_period_s}\n')
    proc = _serve(["--config", str(config), "--port", str(port)], env={"TANDEM_LOG_LEVEL": "info"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"server never became ready: {proc.communicate()[0]}")


def _streams(url: str, count: int, max_tokens: int, n: int = 4, resume: threading.Event | None = None
             ) -> tuple[list[threading.Thread], threading.Barrier, list[dict]]:
    """`count` completion streams of `n` x `max_tokens`; the barrier passes once each has its first chunk.
    `resume`: each stream is a chat completion with 20 top logprobs a token (~1.6 kB of events per token)
    that stops reading after its first chunk until it is set: the body outgrows the socket buffers (the
    client's receive buffer capped at 256 KiB; the server's send buffer grows to 4 MB), so the server's writes block
    and the request stays in flight however fast the engine is (the checkpoint needs a chat template)."""
    started = threading.Barrier(count + 1)
    results: list[dict] = []

    def stream() -> None:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": max_tokens, "n": n, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        path, socket_options = "/v1/completions", None
        if resume is not None:
            del body["prompt"]
            body |= {"messages": [{"role": "user", "content": "hello"}], "logprobs": True, "top_logprobs": 20}
            path, socket_options = "/v1/chat/completions", [(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 << 10)]
        with httpx.Client(transport=httpx.HTTPTransport(socket_options=socket_options), timeout=120) as client, \
                client.stream("POST", url + path, json=body) as r:
            lines = r.iter_lines()
            first = next(lines)
            started.wait()
            if resume is not None:
                resume.wait(timeout=60)
            rest = [line for line in lines if line]
        results.append({"first": first, "rest": rest})

    threads = [threading.Thread(target=stream) for _ in range(count)]
    for t in threads:
        t.start()
    return threads, started, results


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
    # 2,000 sequential decode steps per stream (a 4096-token context): no machine finishes them between a
    # stream's first chunk and the signal, so all four are in flight when the drain begins
    proc, url = _serve_ready(tiny_checkpoint("llama", max_position_embeddings=4096), tmp_path, grace_period_s=60)
    try:
        threads, started, results = _streams(url, 4, max_tokens=2000)
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
        assert r["first"].startswith("data: {") and r["rest"][-1] == "data: [DONE]"
        usage = json.loads(r["rest"][-2][6:])["usage"]
        assert usage["completion_tokens"] == 4 * 2000  # every choice ran to max_tokens: nothing cut off
    assert proc.returncode == 0, out
    assert "draining: 4 request(s) in flight" in out and "Traceback" not in out


@pytest.mark.slow
def test_sigterm_answers_new_requests_503_with_retry_after_while_in_flight_ones_finish(tiny_checkpoint,
                                                                                        tmp_path: Path):
    proc, url = _serve_ready(with_chat_template(tiny_checkpoint("llama"), tmp_path / "chat"), tmp_path,
                             grace_period_s=60)
    pooled = httpx.Client(timeout=10)
    try:
        assert pooled.get(url + "/health").status_code == 200  # a keep-alive connection, idle from here
        resume = threading.Event()
        # 16 x 450 tokens (~12 MB of events) not read until the drain is checked: the stream stays in flight
        threads, started, results = _streams(url, 1, max_tokens=450, n=16, resume=resume)
        started.wait(timeout=60)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the drain has begun: the stream is still running
        refused = [httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                              timeout=10),
                   httpx.get(url + "/ready", timeout=10),  # new connections, each told rather than refused
                   pooled.get(url + "/health")]  # and the idle one, told rather than closed under the client
        resume.set()
        for t in threads:
            t.join(timeout=120)
        out, _ = proc.communicate(timeout=60)
    finally:
        pooled.close()
        if proc.poll() is None:
            proc.kill()
    for r in refused:
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
        assert r.json()["error"]["code"] == "shutting_down" and r.json()["error"]["type"] == "service_unavailable"
    [stream] = results
    assert stream["rest"][-1] == "data: [DONE]"
    assert json.loads(stream["rest"][-2][6:])["usage"]["completion_tokens"] == 16 * 450  # not cut
    assert proc.returncode == 0, out
    assert "Traceback" not in out


@pytest.mark.slow
def test_sigterm_past_the_grace_period_ends_streams_with_an_error_event_and_done(tiny_checkpoint, tmp_path: Path):
    # 4,000 decode steps, one after another, far longer than the grace period on any machine (480 were not on a
    # fast one): the engines are stopped under every request
    proc, url = _serve_ready(tiny_checkpoint("llama", max_position_embeddings=4096), tmp_path, grace_period_s=0.3)
    answers: list[httpx.Response] = []
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4000, "n": 4, "ignore_eos": True}
    try:
        unary = threading.Thread(target=lambda: answers.append(httpx.post(url + "/v1/completions", json=body,
                                                                          timeout=120)))
        unary.start()
        threads, started, results = _streams(url, 4, max_tokens=4000)
        started.wait(timeout=60)
        proc.send_signal(signal.SIGTERM)
        for t in [*threads, unary]:
            t.join(timeout=120)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(results) == 4
    for r in results:
        error, done = r["rest"][-2:]
        assert done == "data: [DONE]"
        assert json.loads(error[6:])["error"]["code"] == "engine_dead"  # the engines stopped under it
    [unary_answer] = answers  # a JSON answer cut the same way is a 503 the client may retry
    assert unary_answer.status_code == 503 and unary_answer.json()["error"]["code"] == "engine_dead"
    assert int(unary_answer.headers["retry-after"]) >= 1
    assert proc.returncode == 0, out
    assert "grace period over: stopping the engines under 5 request(s)" in out
    assert "Traceback" not in out and "Exception in ASGI application" not in out
