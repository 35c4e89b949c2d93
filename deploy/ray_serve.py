"""The Ray Serve application: `OpenAIIngress` (one OpenAI endpoint) in front of `TandemReplica` deployments,
routed by `TandemRequestRouter`, fixed-size or autoscaled by `TandemAutoscalingPolicy`.

    serve run deploy.ray_serve:app                      # defaults (2 replicas of the embedded config)
    serve run deploy.ray_serve:build_app replicas=4 num_gpus=1 config=/etc/tandem.toml
    python -m deploy.ray_serve --replicas 2 --port 8000   # starts Ray locally too
    python -m deploy.ray_serve --direct-ingress --port 8000  # the ingress serves HTTP itself: no proxy hop

Every knob is a field of `ScaleOutOptions` (docs/scale-out.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import uuid
from typing import Any

import msgspec
from ray import serve
from ray.serve import Application

from deploy.ingress import OpenAIIngress
from deploy.replica import TandemReplica

log = logging.getLogger("tandem.deploy")

ROUTER_CLASS = "deploy.router:TandemRequestRouter"
POLICY_CLASS = "deploy.autoscale_policy:TandemAutoscalingPolicy"


class ScaleOutOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How the application is laid out. `replicas` fixes the count; `autoscale` lets the policy move it between
    `min_replicas` and `max_replicas` (starting at `replicas`)."""

    config: str | None = None  # tandem TOML for every replica (default: $TANDEM_CONFIG or the embedded one)
    overrides: dict[str, Any] = msgspec.field(default_factory=dict)  # dotted config keys, e.g. {"kv_pool.memory_bytes": "128MiB"}
    replicas: int = 2
    autoscale: bool = False
    min_replicas: int = 1
    max_replicas: int = 8
    # resources of one replica: a whole tandem (its engines, its KV pool) on one device
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    torch_threads: int = 1  # torch intra-op threads in a replica (CPU serving: one per core it holds)
    pin_cpu: bool = False  # pin each replica to a core of its own (CPU machines)
    stream_interval_ms: float = 0.0  # a stream's chunks at most this often (0: each as it comes; never the first)
    warmup_tokens: int = 2  # a replica streams this many tokens per engine before Serve marks it running (0: off)
    max_ongoing_requests: int = 128  # per replica, above its engines' batch: the rest waits in tandem's queue
    max_queued_requests: int = 1024  # per ingress handle; beyond it a 503 + Retry-After
    graceful_shutdown_timeout_s: float = 60.0  # a scaled-down replica's in-flight requests get this long
    health_check_period_s: float = 2.0
    # routing
    routing: str = "affinity"  # "affinity" (prefix + load) or "pow2" (power of two choices only)
    allow_routing_override: bool = False  # honour a request's `x-tandem-routing: pow2` (benchmarks)
    max_imbalance: float = 3.0  # load (in requests) a prefix holder may exceed the least loaded replica by ...
    imbalance_ratio: float = 0.25  # ... plus this fraction of that replica's requests in flight
    kv_weight: float = 2.0  # a full KV pool weighs as this many requests in flight in a replica's load
    kv_high: float = 0.95  # a prefix holder whose pool is fuller than this is passed over
    slo_gap: float = 0.05  # ... and one missing its SLO when another replica's attainment is this much better
    routing_stats_period_s: float = 1.0  # how often replicas report KV usage and SLO headroom to routers
    # autoscaling on tandem's signals (gateway.autoscale: the [autoscale] fields; see docs/autoscaling.md)
    target_ongoing_requests: float | None = 16.0  # in flight per replica that weighs as the waiting target
    target_waiting_per_replica: float = 8.0
    target_kv_usage: float = 0.8
    down_stabilization_s: float = 300.0
    down_cooldown_s: float = 120.0
    max_scale_up_step: int = 4
    look_back_period_s: float = 10.0  # Ray averages the replicas' reports over this window
    # the ingress
    ingress_replicas: int = 1
    ingress_num_cpus: float = 0.0  # the ingress parses bodies and hashes text: no core of its own
    retries: int = 2  # replicas tried for a request whose replica died before its first byte
    access_log: bool = False  # Serve's per-request access log lines in the ingress and replicas (CPU per request)
    first_byte_timeout_s: float = 600.0
    # the Ray actor every replica leases its API keys' limits from (default: a new one per build_app), so N
    # replicas admit the configured requests/min and tokens/min, not N times them
    limits_bank: str | None = None

    def __post_init__(self) -> None:
        if self.routing not in ("affinity", "pow2"):
            raise ValueError(f"routing = {self.routing!r}: expected 'affinity' or 'pow2'")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"min_replicas = {self.min_replicas}, max_replicas = {self.max_replicas}: "
                             "expected 1 <= min_replicas <= max_replicas")
        if self.autoscale and not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(f"replicas = {self.replicas} must lie within min_replicas..max_replicas when autoscaling")


def _coerce(args: dict[str, Any]) -> ScaleOutOptions:
    """`serve run ... key=value` passes strings: decode each as JSON when it parses (numbers, booleans,
    objects), else keep the string."""
    out: dict[str, Any] = {}
    for key, value in args.items():
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                pass
        out[key] = value
    return msgspec.convert(out, ScaleOutOptions, strict=False)


def autoscaling_config(o: ScaleOutOptions) -> dict[str, Any]:
    kwargs = {"target_ongoing_requests": o.target_ongoing_requests, "min_replicas": o.min_replicas,
              "max_replicas": o.max_replicas, "target_waiting_per_replica": o.target_waiting_per_replica,
              "target_kv_usage": o.target_kv_usage, "down_stabilization_s": o.down_stabilization_s,
              "down_cooldown_s": o.down_cooldown_s, "max_scale_up_step": o.max_scale_up_step}
    return {"min_replicas": o.min_replicas, "max_replicas": o.max_replicas, "initial_replicas": o.replicas,
            "look_back_period_s": o.look_back_period_s,
            # Serve wraps a custom policy in its own delays (30 s up, 600 s down by default); the policy's
            # Autoscaler already holds tandem's hysteresis, so Serve's own is off.
            "upscale_delay_s": 0.0, "downscale_delay_s": 0.0,
            "policy": {"policy_function": POLICY_CLASS, "policy_kwargs": kwargs}}


class TandemReplicaDeployment(TandemReplica):
    """The replica as Serve runs it (Serve calls an async `__del__` when it stops a replica)."""

    async def __del__(self) -> None:  # type: ignore[misc]
        await self.shutdown()


def build_app(args: dict[str, Any] | ScaleOutOptions | None = None) -> Application:
    """The application for `serve run deploy.ray_serve:build_app key=value ...` (or `serve.run`)."""
    o = args if isinstance(args, ScaleOutOptions) else _coerce(args or {})
    replica_options: dict[str, Any] = {
        "name": "TandemReplica",
        "ray_actor_options": {"num_cpus": o.num_cpus, "num_gpus": o.num_gpus},
        "max_ongoing_requests": o.max_ongoing_requests,
        "max_queued_requests": o.max_queued_requests,
        "graceful_shutdown_timeout_s": o.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": 1.0,
        "health_check_period_s": o.health_check_period_s,
        "logging_config": {"enable_access_log": o.access_log},
        "request_router_config": {
            "request_router_class": ROUTER_CLASS,
            "request_router_kwargs": {"affinity": o.routing == "affinity", "max_imbalance": o.max_imbalance,
                                      "imbalance_ratio": o.imbalance_ratio, "kv_weight": o.kv_weight,
                                      "kv_high": o.kv_high, "slo_gap": o.slo_gap},
            "request_routing_stats_period_s": o.routing_stats_period_s,
            "request_routing_stats_timeout_s": max(1.0, 2 * o.routing_stats_period_s)},
    }
    if o.autoscale:
        replica_options["autoscaling_config"] = autoscaling_config(o)
    else:
        replica_options["num_replicas"] = o.replicas
    replicas = serve.deployment(TandemReplicaDeployment).options(**replica_options).bind(
        o.config, o.overrides, torch_threads=o.torch_threads, pin_cpu=o.pin_cpu,
        stream_interval_s=o.stream_interval_ms / 1000.0, warmup_tokens=o.warmup_tokens,
        limits_bank=o.limits_bank or f"tandem-rate-limits-{uuid.uuid4().hex[:12]}")
    ingress = serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress", num_replicas=o.ingress_replicas, max_ongoing_requests=4 * o.max_queued_requests,
        ray_actor_options={"num_cpus": o.ingress_num_cpus}, logging_config={"enable_access_log": o.access_log})
    return ingress.bind(replicas, affinity=o.routing == "affinity", allow_routing_override=o.allow_routing_override,
                        retries=o.retries, first_byte_timeout_s=o.first_byte_timeout_s)


REPLICA_ACTOR_PREFIX = "SERVE_REPLICA::"


def direct_ingress_env(port: int, ingress_replicas: int = 1) -> dict[str, str]:
    """The Ray cluster's environment (set before Ray starts: the controller and the replicas read it at
    import) for Serve's direct ingress: the ingress replicas serve HTTP themselves on ports from `port` up,
    so a request makes one Ray hop (ingress -> replica) instead of two (proxy -> ingress -> replica). Serve's
    proxy stays up but carries nothing. More than one ingress replica needs a load balancer in front."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + max(8, 4 * ingress_replicas)),
            "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(port + 1000),
            "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(port + 1000 + max(8, 4 * ingress_replicas))}


def ingress_urls(app_name: str = "tandem", host: str | None = None) -> list[str]:
    """Where the application takes HTTP: the ingress replicas' own ports under direct ingress, else Serve's
    proxies (the controller's target groups). `host` replaces the targets' node address (a local run: the
    address uvicorn was bound to, e.g. 127.0.0.1)."""
    import ray
    from ray.serve.context import _get_global_client

    groups = ray.get(_get_global_client()._controller.get_target_groups.remote(app_name))
    return [f"http://{host or t.ip}:{t.port}" for g in groups if str(g.protocol).endswith("HTTP")
            for t in g.targets]


def replica_actors(app_name: str = "tandem", deployment: str = "TandemReplica") -> dict[str, Any]:
    """The live replicas of `deployment` as {replica id (as `x-tandem-replica` names it): actor handle}."""
    import ray

    prefix = f"{REPLICA_ACTOR_PREFIX}{app_name}#{deployment}#"
    return {a["name"][len(prefix):]: ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)}


def replica_stats(app_name: str = "tandem", timeout_s: float = 10.0) -> dict[str, dict[str, Any]]:
    """Each live replica's `record_routing_stats` (its pool's prefix counters and pages included); a replica
    that does not answer in time (dying, starting) is left out."""
    import ray

    out = {}
    for rid, actor in replica_actors(app_name).items():
        try:
            out[rid] = ray.get(actor.record_routing_stats.remote(), timeout=timeout_s)
        except Exception:  # dead or not yet initialised
            continue
    return out


app = build_app({"config": os.environ.get("TANDEM_CONFIG")} if os.environ.get("TANDEM_CONFIG") else None)


def main(argv: list[str] | None = None) -> int:
    """`python -m deploy.ray_serve` (and `tandem serve --ray`): start or join Ray, run the app, serve until
    Ctrl-C or SIGTERM."""
    parser = argparse.ArgumentParser(prog="tandem serve --ray", description="Run tandem replicas on Ray Serve.")
    parser.add_argument("--config", default=None, help="tandem TOML for every replica")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--address", default=None, help="Ray cluster to join (default: start one here)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--autoscale", action="store_true", help="scale between --min-replicas and --max-replicas")
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--max-replicas", type=int, default=8)
    parser.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per replica")
    parser.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per replica")
    parser.add_argument("--routing", choices=["affinity", "pow2"], default="affinity")
    parser.add_argument("--pin-cpu", action="store_true", help="pin each replica to a core of its own")
    parser.add_argument("--direct-ingress", action="store_true",
                        help="the ingress serves HTTP on --port itself (no proxy hop; Ray started here)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="any other ScaleOutOptions field (JSON value), repeatable")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fields: dict[str, Any] = {"config": args.config, "replicas": args.replicas, "autoscale": args.autoscale,
                              "min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
                              "num_cpus": args.num_cpus, "num_gpus": args.num_gpus, "routing": args.routing,
                              "pin_cpu": args.pin_cpu}
    for item in args.option:
        key, _, value = item.partition("=")
        fields[key] = value
    try:
        options = _coerce({k: v for k, v in fields.items() if v is not None})
    except (msgspec.ValidationError, ValueError) as exc:
        print(f"tandem serve --ray: {exc}", file=sys.stderr)
        return 2
    import ray

    proxy_port = args.port
    if args.direct_ingress:
        if args.address is not None:
            log.error("--direct-ingress sets the Ray cluster's environment: start the cluster with "
                      "RAY_SERVE_ENABLE_DIRECT_INGRESS=1 instead (docs/scale-out.md)")
            return 2
        os.environ.update(direct_ingress_env(args.port, options.ingress_replicas))
        from gateway.http_guard import free_port

        proxy_port = free_port()  # the proxy still runs (idle): off the endpoint's port
    ray.init(address=args.address, ignore_reinit_error=True)
    serve.start(http_options={"host": args.host, "port": proxy_port},
                logging_config={"enable_access_log": options.access_log})
    serve.run(build_app(options), name="tandem", route_prefix="/")
    urls = ingress_urls("tandem", host=args.host) if args.direct_ingress else [f"http://{args.host}:{args.port}"]
    log.info("tandem on Ray Serve: %s (%s)", ", ".join(u + "/v1" for u in urls),
             "autoscaled" if options.autoscale else f"{options.replicas} replicas")
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    try:
        while not stop:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    serve.delete("tandem")  # replicas drain: in-flight requests finish (graceful_shutdown_timeout_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
