"""`tandem serve`: load the configuration, build the app and run it on uvicorn. SIGTERM (or Ctrl-C) drains
(`DrainingServer`): new requests get 503 + Retry-After, in-flight ones get `server.grace_period_s` to finish,
then the engines stop, which ends what is left with an error (a 503, or an error event and `[DONE]` on a
stream), and the process exits 0. `ServerThread` runs the same server in a background thread (tests and
benchmarks). `GuardedHttpToolsProtocol` holds the HTTP limits a client cannot outlast: header size (431),
header and body read deadlines (408).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, get_args

import msgspec
import uvicorn

from engines.config import Quantization
from gateway.config import ConfigError, TandemConfig, apply_env_overrides, config_from_dict, read_config_file
from gateway.engine_setup import check_checkpoints
from gateway.http_guard import GuardedHttpToolsProtocol, HTTPLimits, error_body, free_port  # noqa: F401 (tests, bench)

log = logging.getLogger("tandem.gateway")


DRAIN_RETRY_AFTER_S = 1  # a draining replica's 503: retry soon, on another replica
CUT_S = 5.0  # past the grace period: how long the requests the stopped engines ended get to send their last bytes
WATCHDOG_SLACK_S = 5.0  # past grace + CUT_S: the drain itself is stuck and the process ends anyway
EXIT_FORCED = 3  # `tandem serve`'s exit status when the watchdog ended a drain that hung (docs/configuration.md)


def _exit_after(seconds: float) -> None:
    time.sleep(seconds)
    log.error("the drain did not end within %g s of SIGTERM: exiting with status %d", seconds, EXIT_FORCED)
    logging.shutdown()
    os._exit(EXIT_FORCED)


def exit_now(code: int) -> None:
    """End the process with `code` once the drain is done, even when a worker thread still runs a job that
    cannot be interrupted (a grammar compile, a tokenisation): the interpreter would wait for it at exit."""
    lingering = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
                 and t.is_alive()]
    if lingering:
        log.warning("drained; ending %d worker thread(s) still busy: %s", len(lingering), ", ".join(lingering))
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


class Draining:
    """The ASGI app as the server runs it: the app itself, or once a drain has begun, a 503 + Retry-After for
    every new request (its connection is accepted and told, not refused)."""

    def __init__(self, app: Any):
        self.app = app
        self.active = False

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if not self.active or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = error_body(503, "The server is shutting down; retry on another replica", "shutting_down")
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
            (b"retry-after", b"%d" % DRAIN_RETRY_AFTER_S), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})


class DrainingServer(uvicorn.Server):
    """uvicorn's server with tandem's drain in place of its shutdown (which stops accepting at once and cancels
    what outlasts the grace period: streams cut with no end, a traceback each). New requests are answered 503
    + Retry-After until the end; in-flight ones get the grace period; then the app's lifespan shutdown stops
    the engines, which ends each request still running with an engine error (a 503, or an SSE error event and
    `[DONE]`), and only what outlasts that too is cut."""

    def __init__(self, config: uvicorn.Config, draining: Draining):
        super().__init__(config)
        self.draining = draining
        self.exit_watchdog = False  # `tandem serve`: the process ends by EXIT_FORCED if the drain hangs

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.draining.active = True
        if self.exit_watchdog:
            limit = (self.config.timeout_graceful_shutdown or 0.0) + CUT_S + WATCHDOG_SLACK_S
            threading.Thread(target=_exit_after, args=(limit,), name="exit-watchdog", daemon=True).start()
        in_flight = set(self.server_state.tasks)
        for connection in list(self.server_state.connections):
            if connection.cycle is not None and not connection.cycle.response_complete:
                connection.shutdown()  # it closes after its answer; an idle one stays open to be told 503
        grace = self.config.timeout_graceful_shutdown or 0.0
        log.info("draining: %d request(s) in flight get up to %g s; new requests get 503", len(in_flight), grace)
        ended = await self._settled(in_flight, grace)
        if not ended:
            log.warning("grace period over: stopping the engines under %d request(s) still in flight",
                        sum(not task.done() for task in in_flight))
        if not self.force_exit:
            await self.lifespan.shutdown()  # the engines stop: what still runs ends with an engine error
        if not ended and not await self._settled(in_flight, CUT_S):
            for connection in list(self.server_state.connections):
                connection.transport.close()  # the app sees a disconnect; the client a cut connection
            await self._settled(in_flight, 1.0)
            for task in in_flight:
                task.cancel()
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        await self._settled(set(self.server_state.tasks), 1.0)  # the last 503s go out
        for connection in list(self.server_state.connections):
            connection.shutdown()

    async def _settled(self, tasks: set[asyncio.Task], timeout: float) -> bool:
        """Wait up to `timeout` s for `tasks` (a second Ctrl-C ends the wait); whether they all finished."""
        deadline = time.monotonic() + timeout
        while not all(task.done() for task in tasks):
            if self.force_exit or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True


def build_server(cfg: TandemConfig, app: Any, *, sock: socket.socket | None = None,
                 limits: HTTPLimits | None = None) -> DrainingServer:
    limits = limits or HTTPLimits(cfg.server.max_header_bytes, cfg.server.header_timeout_s, cfg.server.body_timeout_s)
    from gateway.fast_path import FastPath  # imports the app (torch): not before a bad config has failed

    draining = Draining(FastPath.over(app))
    config = uvicorn.Config(
        draining, host=cfg.server.host, port=cfg.server.port, log_level=cfg.server.log_level,
        timeout_graceful_shutdown=cfg.server.grace_period_s, access_log=False, lifespan="on",
        http=functools.partial(GuardedHttpToolsProtocol, limits=limits),
        # Our own limits answer 413/503 in OpenAI's shape; uvicorn's would be plain text.
        limit_concurrency=None, timeout_keep_alive=5, ws="none")
    return DrainingServer(config, draining)


# `tandem serve` flags, vLLM's names: (flag, type or choices, config key ("*": every engine), help). A flag given
# overrides the config file and TANDEM_* variables; `--help` prints each one's key.
ENGINE_FLAGS: list[tuple[str, Any, str, str]] = [
    ("--max-model-len", int, "engines.*.max_model_len", "context length in tokens (prompt + output)"),
    ("--dtype", ["auto", "float32", "bfloat16", "float16"], "engines.*.dtype", "the weights' dtype"),
    ("--quantization", list(get_args(Quantization)), "engines.*.quantization",
     "weight quantization (int8/int4 weight-only; w8a8: int8 weights and activations, CPU; "
     "bf16: bfloat16 weights and activations)"),
    ("--max-num-seqs", int, "engines.*.max_num_seqs", "sequences in one step at most"),
    ("--max-num-batched-tokens", int, "engines.*.max_num_batched_tokens", "tokens in one step at most"),
    ("--num-speculative-tokens", int, "engines.*.num_speculative_tokens",
     "draft tokens per step at most, for engines with a draft (default 4)"),
]
POOL_FLAGS: list[tuple[str, Any, str, str]] = [
    ("--gpu-memory-utilization", float, "kv_pool.memory_fraction",
     "fraction of free GPU memory the KV pool takes (and kv_pool.memory_bytes is cleared so it applies)"),
    ("--kv-cache-dtype", ["auto", "float16", "bfloat16", "float32", "int8", "fp8"], "kv_pool.kv_cache_dtype",
     "KV cache storage"),
    ("--block-size", int, "kv_pool.block_size", "tokens per KV page"),
]
SERVE_EXAMPLES = """\
examples:
  tandem serve                                     # the embedded default: two tiny models, four routes
  tandem serve models/tandem-tiny-l --served-model-name tiny --port 8011
  tandem serve models/tandem-tiny-l --draft models/tandem-tiny-s --max-model-len 512 --port 8012

`tandem serve --ray ...` runs tandem replicas on Ray Serve instead (`tandem serve --ray --help`; docs/scale-out.md).

With MODEL the server runs exactly that checkpoint as one model (its draft, when given, only drafts): no
TOML needed, and the configured engines and routes are not loaded (--config then still gives the [server],
[auth], [telemetry]... sections). Precedence: flags > TANDEM_* variables > the config file > defaults.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem serve", description="Run the OpenAI-compatible gateway.",
                                     epilog=SERVE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="a Hugging Face checkpoint folder, a .gguf file or a Hub id ORG/NAME to serve as "
                             "the only model (config: engines.NAME.checkpoint; default: the config's engines and "
                             "routes)")
    parser.add_argument("--revision", default=None, metavar="REV",
                        help="with a Hub id MODEL: its branch, tag or commit (config: engines.NAME.revision; "
                             "default: main)")
    parser.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help="TOML config file (default: $TANDEM_CONFIG or the embedded default)")
    parser.add_argument("--draft", default=None, metavar="DIR",
                        help="with MODEL: a checkpoint folder, .gguf file or Hub id (same tokenizer) that drafts "
                             "for it, speculative decoding (config: engines.NAME-draft.checkpoint and "
                             "engines.NAME.draft)")
    parser.add_argument("--draft-revision", default=None, metavar="REV",
                        help="with a Hub id --draft: its branch, tag or commit (config: "
                             "engines.NAME-draft.revision)")
    parser.add_argument("--draft-quantization", default=None, choices=list(get_args(Quantization)),
                        help="with --draft: the draft engine's own quantization, after --quantization (a draft "
                             "changes only how many tokens are accepted, never the output; w8a8 makes a CPU "
                             "draft's passes about 2x cheaper) (config: engines.NAME-draft.quantization)")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="with MODEL: the name clients send as `model` (config: the NAME of "
                             "[engines.NAME]; default: MODEL as given)")
    for flag, kind, key, text in ENGINE_FLAGS + POOL_FLAGS:
        if isinstance(kind, list):
            parser.add_argument(flag, choices=kind, default=None, help=f"{text} (config: {key})")
        else:
            metavar = "N" if kind is int else "F"
            parser.add_argument(flag, type=kind, default=None, metavar=metavar, help=f"{text} (config: {key})")
    parser.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help="require this bearer key; repeat for more (config: auth.api_keys)")
    parser.add_argument("--host", default=None, help="bind address (config: server.host)")
    parser.add_argument("--port", type=int, default=None, help="port (config: server.port)")
    parser.add_argument("--log-level", default=None, choices=["critical", "error", "warning", "info", "debug"],
                        help="log level (config: server.log_level)")
    return parser


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> TandemConfig:
    """The configuration `tandem serve` runs with: the file (or the embedded default), TANDEM_* variables, then
    the flags. With MODEL the engines and routes are replaced by one engine named --served-model-name."""
    env = os.environ if env is None else env
    if args.draft_quantization is not None and args.draft is None:
        raise ConfigError("--draft-quantization needs --draft: tandem serve MODEL --draft DIR --draft-quantization ...")
    if args.draft_revision is not None and args.draft is None:
        raise ConfigError("--draft-revision needs --draft: tandem serve MODEL --draft ORG/NAME --draft-revision ...")
    if args.model is None:
        for flag in ("draft", "served_model_name", "revision"):
            if getattr(args, flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')} needs MODEL: tandem serve MODEL "
                                  f"--{flag.replace('_', '-')} ...")
    path = args.config if args.config is not None else env.get("TANDEM_CONFIG") or None
    raw: dict[str, Any] = {}
    base = Path.cwd()
    if path is not None or args.model is None:
        file, raw, base = read_config_file(path)
        source = str(file)
    else:
        source = "tandem serve " + args.model
    applied = apply_env_overrides(raw, env)
    if applied:
        source += f" (with {', '.join(applied)} from the environment)"
    if args.model is not None:
        name = args.served_model_name or args.model
        engine: dict[str, Any] = {"checkpoint": _checkpoint_arg(args.model)}
        if args.revision is not None:
            engine["revision"] = args.revision
        engines = {name: engine}
        if args.draft is not None:
            engine["draft"] = f"{name}-draft"
            engines[f"{name}-draft"] = {"checkpoint": _checkpoint_arg(args.draft), "served": False}
            if args.draft_revision is not None:
                engines[f"{name}-draft"]["revision"] = args.draft_revision
        raw["engines"], raw["routes"] = engines, {}
    for flag, _, key, _ in ENGINE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            for entry in (raw.get("engines") or {}).values():
                if isinstance(entry, dict) and (flag != "--num-speculative-tokens" or entry.get("draft")):
                    entry[key.split(".")[-1]] = value
    if args.draft_quantization is not None:
        raw["engines"][f"{args.served_model_name or args.model}-draft"]["quantization"] = args.draft_quantization

    def section(name: str) -> dict[str, Any]:
        table = raw.setdefault(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: {name} = {table!r} is invalid: expected a table [{name}]")
        return table
    for flag, _, key, _ in POOL_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            section("kv_pool")[key.split(".")[-1]] = value
    if args.gpu_memory_utilization is not None:
        section("kv_pool").pop("memory_bytes", None)  # a fixed size would win over the fraction
    if args.api_key is not None:
        section("auth")["api_keys"] = list(args.api_key)
    for flag in ("host", "port", "log_level"):
        if getattr(args, flag) is not None:
            section("server")[flag] = getattr(args, flag)
    return config_from_dict(raw, base_dir=base, source=source)


def _checkpoint_arg(value: str) -> str:
    """MODEL / --draft as given: an existing path (made absolute), else a Hub id left as it is."""
    from engines.formats.hub import is_hub_id

    path = Path(value).expanduser()
    return value if is_hub_id(value) and not path.exists() else str(path.resolve())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--ray" in argv:  # replicas on Ray Serve (docs/scale-out.md); `tandem serve --ray --help` lists its flags
        from deploy.ray_serve import main as ray_main

        return ray_main([a for a in argv if a != "--ray"])
    args = build_parser().parse_args(argv)
    gc.disable()  # until the engines are up: the app's start-up load freezes what start-up made and enables it
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
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
    server.exit_watchdog = True
    # uvicorn re-raises the captured SIGTERM after its graceful shutdown; by then the drain is done, so the
    # re-raised signal should end main() normally instead of killing the process with status 143.
    signal.signal(signal.SIGTERM, lambda *_: log.info("drained; exiting"))
    server.run()
    if failed:
        print(f"tandem serve: {failed[0]}", file=sys.stderr)
        exit_now(1)
    exit_now(0)
    return 0  # not reached


class ServerThread:
    """Run the gateway on 127.0.0.1 in a background thread; `start()` returns once `/ready` (or `/health`
    when `wait_ready=False`) answers. For tests and benchmarks; `tandem serve` is the real entry point."""

    def __init__(self, cfg: TandemConfig, *, app_factory: Callable[[TandemConfig], Any] | None = None,
                 port: int | None = None, http_limits: HTTPLimits | None = None, **app_kwargs: Any):
        from gateway.app import create_app

        self.port = port or free_port()
        server_cfg = msgspec.structs.replace(cfg.server, host="127.0.0.1", port=self.port, log_level="warning")
        self.cfg = msgspec.structs.replace(cfg, server=server_cfg)
        self.app = app_factory(self.cfg) if app_factory else create_app(self.cfg, **app_kwargs)
        self.server = build_server(self.cfg, self.app, limits=http_limits)
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
