"""`tandem serve`: load the configuration, build the app and run it on uvicorn. SIGTERM (or Ctrl-C) stops
accepting connections, lets in-flight requests finish within `server.grace_period_s`, shuts the engines
down and exits 0. `ServerThread` runs the same server in a background thread (tests and benchmarks).
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn

from gateway.config import ConfigError, TandemConfig, check_checkpoints, load_config

log = logging.getLogger("tandem.gateway")


def build_server(cfg: TandemConfig, app: Any, *, sock: socket.socket | None = None) -> uvicorn.Server:
    config = uvicorn.Config(
        app, host=cfg.server.host, port=cfg.server.port, log_level=cfg.server.log_level,
        timeout_graceful_shutdown=cfg.server.grace_period_s, access_log=False, lifespan="on",
        # Our own limits answer 413/503 in OpenAI's shape; uvicorn's would be plain text.
        limit_concurrency=None, timeout_keep_alive=5, h11_max_incomplete_event_size=None)
    return uvicorn.Server(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem serve", description="Run the OpenAI-compatible gateway.")
    parser.add_argument("--config", type=Path, default=None,
                        help="TOML config file (default: $TANDEM_CONFIG or the embedded default)")
    parser.add_argument("--host", default=None, help="bind address (overrides server.host)")
    parser.add_argument("--port", type=int, default=None, help="port (overrides server.port)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides: dict[str, Any] = {}
    if args.host is not None:
        overrides["server.host"] = args.host
    if args.port is not None:
        overrides["server.port"] = args.port
    try:
        cfg = load_config(args.config, overrides=overrides)
        check_checkpoints(cfg)
    except ConfigError as exc:
        print(f"tandem serve: configuration error: {exc}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(cfg.server.log_level.upper())

    # Imported only now: they load torch, and a bad config should fail in a blink.
    from gateway.app import create_app
    from gateway.auth import warn_if_open

    server: uvicorn.Server | None = None
    failed: list[str] = []

    def on_load_error(message: str) -> None:
        failed.append(message)
        if server is not None:
            server.should_exit = True  # a server whose engines cannot load should not pretend to be up

    app = create_app(cfg, on_load_error=on_load_error)
    warn_if_open(app.state.gateway.keyring, cfg.server.host)
    server = build_server(cfg, app)
    # uvicorn re-raises the captured SIGTERM after its graceful shutdown; by then the drain is done, so the
    # re-raised signal should end main() normally instead of killing the process with status 143.
    signal.signal(signal.SIGTERM, lambda *_: log.info("drained; exiting"))
    server.run()
    if failed:
        print(f"tandem serve: {failed[0]}", file=sys.stderr)
        return 1
    return 0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """Run the gateway on 127.0.0.1 in a background thread; `start()` returns once `/ready` (or `/health`
    when `wait_ready=False`) answers. For tests and benchmarks; `tandem serve` is the real entry point."""

    def __init__(self, cfg: TandemConfig, *, app_factory: Callable[[TandemConfig], Any] | None = None,
                 port: int | None = None, **app_kwargs: Any):
        import msgspec

        from gateway.app import create_app

        self.port = port or free_port()
        server_cfg = msgspec.structs.replace(cfg.server, host="127.0.0.1", port=self.port, log_level="warning")
        self.cfg = msgspec.structs.replace(cfg, server=server_cfg)
        self.app = app_factory(self.cfg) if app_factory else create_app(self.cfg, **app_kwargs)
        self.server = build_server(self.cfg, self.app)
        self.thread = threading.Thread(target=self.server.run, name="tandem-gateway", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, wait_ready: bool = True, timeout: float = 60.0) -> ServerThread:
        import httpx

        self.thread.start()
        path = "/ready" if wait_ready else "/health"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + path, timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if not self.thread.is_alive():
                raise RuntimeError("the gateway thread exited during start-up")
            state = self.app.state.gateway
            if state.load_error:
                self.stop()
                raise RuntimeError(state.load_error)
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"gateway not ready within {timeout} s")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
