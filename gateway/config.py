"""tandem's configuration in one typed place: msgspec Structs loaded from TOML plus `TANDEM_*` environment
overrides, validated at start-up with errors that name the field, the bad value and what is allowed, and
mapped onto the engine contract (`engines.EngineSpec` / `engines.PoolSpec`) in one function.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from engines.compile_pool import CompileLimits
from engines.config import EngineOptions, PoolSpec, check_drafts
from gateway.config_messages import ConfigError, convert_section

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent / "default.toml"
DEFAULT_ROUTER_ARTIFACT = PROJECT_ROOT / "models" / "router"  # a router route without `artifact` uses it
DEFAULT_CASCADE_SCORER = DEFAULT_ROUTER_ARTIFACT / "cascade"  # a learned cascade without `scorer` uses it
ENV_PREFIX = "TANDEM_"

# Route strategies a config may name; gateway.routes.register_strategy adds to it.
STRATEGY_NAMES: set[str] = {"fixed", "router", "cascade"}

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeFloat = Annotated[float, Meta(ge=0)]
Fraction = Annotated[float, Meta(gt=0, le=1)]


class EngineConfig(EngineOptions, forbid_unknown_fields=True, kw_only=True):
    """[engines.NAME]: the engine's options (engines.config.EngineOptions, defined there once) and where its
    model lives."""

    # a Hugging Face folder or a .gguf file (relative paths are relative to the config file's folder), or a Hub
    # id ORG/NAME where no such path exists (`revision` picks its branch, tag or commit)
    checkpoint: str
    device: str = "auto"  # auto | cpu | cuda | cuda:N (every engine shares one device)
    served: bool = True  # also a model of its own (`model` = its name); false: a draft that only drafts
    pooling: Literal["mean", "last"] = "mean"  # /v1/embeddings: the last hidden state's mean, or its last token


class KVPoolConfig(PoolSpec, forbid_unknown_fields=True, kw_only=True):
    """[kv_pool]: engines.config.PoolSpec, with sizes written as text ("512MiB") allowed."""

    memory_bytes: int | str | None = None  # an integer or a size such as "512MiB"; wins over memory_fraction


class SLOConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    ttft_ms: Annotated[float, Meta(gt=0)] | None = None
    tpot_ms: Annotated[float, Meta(gt=0)] | None = None
    percentile: Annotated[float, Meta(gt=0, le=100)] = 99.0


class RouterConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    threshold: Annotated[float, Meta(ge=0, le=1)] | None = None  # P(large needed) above this -> large
    target_large_fraction: Fraction | None = None  # or calibrate the threshold to send this share to large
    artifact: str | None = None  # router artifact folder (JSON + npz); unset: models/router of the project
    # with target_large_fraction: the threshold follows the (1 - target) quantile of the last `window` scores
    # once `warmup` are seen, so the target holds on traffic the artifact never saw; false: the artifact's
    # held-out quantile, fixed
    hold_target: bool = True
    window: Annotated[int, Meta(ge=10, le=100_000)] = 1000  # recent scores held (also the drift check's sample)
    warmup: Annotated[int, Meta(ge=1, le=100_000)] = 100  # scores seen before the threshold follows the window
    drift_min_ks: Annotated[float, Meta(gt=0, le=1)] = 0.1  # warn when the KS distance reaches this (and p<0.001)
    history_interval_s: Annotated[float, Meta(gt=0, le=86_400)] = 60.0  # one /v1/routes history bucket per this
    # shadow labels: this share of requests also runs greedily on both engines in the background (at most
    # shadow_max_inflight at once, shadow_max_tokens each); their agreement is a label (gateway/shadow.py)
    shadow_fraction: Annotated[float, Meta(ge=0, le=0.5)] = 0.0
    shadow_max_inflight: Annotated[int, Meta(ge=1, le=64)] = 1
    shadow_max_tokens: Annotated[int, Meta(ge=1, le=1024)] = 32
    shadow_labels: str | None = None  # JSONL the labels go to (features, no prompt text); unset: counts only
    shadow_max_records: Annotated[int, Meta(ge=1, le=10_000_000)] = 10_000  # then rotated once to <file>.1
    # periodic refit from the shadow labels (gateway/router_refit.py; off unless set): every refit_interval_s,
    # once refit_min_labels new labels are in, refit, validate on held-back labels, swap in only when better
    refit_interval_s: Annotated[float, Meta(gt=0)] | None = None
    refit_min_labels: Annotated[int, Meta(ge=20)] = 500
    refit_dir: str | None = None  # where an adapted artifact goes (the previous one: <refit_dir>.previous)


class CascadeConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    confidence_threshold: Annotated[float, Meta(le=0)] = -1.0  # token logprob; below it -> escalate
    # mean / min: the small answer's raw token-logprob confidence; learned: the escalation scorer (`scorer`)
    mode: Literal["mean", "min", "learned"] = "mean"
    scorer: str | None = None  # learned: escalation scorer folder (JSON + npz); unset: models/router/cascade
    escalation_threshold: Annotated[float, Meta(ge=0, le=1)] | None = None  # learned: P >= this -> escalate
    target_escalation_fraction: Fraction | None = None  # learned: or the threshold escalating this share
    # learned: each finished verification (escalation) is a label for `tandem router adapt`: the scorer's
    # features, the agreement of the small and large answers and the accepted share, no text (gateway/cascade.py)
    verification_labels: str | None = None
    verification_max_records: Annotated[int, Meta(ge=1, le=10_000_000)] = 10_000  # then rotated once to <file>.1


class RouteConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    engines: list[str]  # fixed: [engine]; router and cascade: [small, large]
    strategy: str = "fixed"  # fixed | router | cascade, or a name added with routes.register_strategy
    slo: SLOConfig = msgspec.field(default_factory=SLOConfig)
    priority: int = 0  # lower runs first, as in vLLM
    max_tokens: PositiveInt | None = None  # cap on a request's max_tokens for this route
    allow_downgrade: bool = False  # under SLO pressure a large choice may be served by the small engine
    max_waiting: PositiveInt | None = None  # admitted requests still before their first token; None: [admission]
    router: RouterConfig = msgspec.field(default_factory=RouterConfig)
    cascade: CascadeConfig = msgspec.field(default_factory=CascadeConfig)
    description: str = ""


class APIKeyConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    key: Annotated[str, Meta(min_length=1)]
    name: str | None = None
    requests_per_minute: PositiveInt | None = None  # None: the auth section's default
    tokens_per_minute: PositiveInt | None = None


class AuthConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    api_keys: list[Annotated[str, Meta(min_length=1)] | APIKeyConfig] = msgspec.field(default_factory=list)
    requests_per_minute: PositiveInt | None = None  # per key; None: unlimited
    tokens_per_minute: PositiveInt | None = None  # per key, prompt + completion tokens; None: unlimited
    # tokens per minute are reserved at admission (prompt + n x max_tokens) and settled to the real usage at
    # the end; a request without max_tokens reserves this many per choice (at most what its context leaves)
    reserved_completion_tokens: PositiveInt = 256

    def keys(self) -> list[APIKeyConfig]:
        """Every key with its own limits resolved against the section defaults."""
        out = []
        for entry in self.api_keys:
            key = APIKeyConfig(key=entry) if isinstance(entry, str) else entry
            out.append(APIKeyConfig(
                key=key.key, name=key.name,
                requests_per_minute=key.requests_per_minute or self.requests_per_minute,
                tokens_per_minute=key.tokens_per_minute or self.tokens_per_minute))
        return out


class ServerConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    max_body_bytes: PositiveInt = 1 << 20
    grace_period_s: NonNegativeFloat = 30.0  # SIGTERM: in-flight requests get this long to finish
    max_inflight_requests: PositiveInt = 1024  # beyond it new requests get 503 with Retry-After
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    # a request's own chat template (chat_template_kwargs.chat_template) is code the server runs: refused
    # unless the operator opts in (CVE-2025-61620 class); compiled request templates sit in a bounded cache
    allow_request_chat_template: bool = False
    max_header_bytes: Annotated[int, Meta(ge=1024)] = 64 << 10  # request line plus headers; beyond it a 431
    header_timeout_s: Annotated[float, Meta(gt=0)] = 10.0  # first byte to last header; past it a 408
    body_timeout_s: Annotated[float, Meta(gt=0)] = 30.0  # last header to the body's last byte; past it a 408


class TelemetryConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    service_name: str = "tandem"
    record_content: bool = False  # prompts and completions enter spans/logs only when True
    otlp: bool = True  # export spans over OTLP/HTTP when OTEL_EXPORTER_OTLP_ENDPOINT is set
    slo_window_s: Annotated[float, Meta(gt=0)] = 300.0  # sliding window for live SLO attainment
    # Prometheus names are "<metric_prefix>:<name>"; "vllm" exports vLLM's exact names (docs/metrics.md)
    metric_prefix: Annotated[str, Meta(pattern=r"^[a-zA-Z_][a-zA-Z0-9_]*$")] = "tandem"


class AdmissionConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """Admission control (gateway/admission.py): shed or downgrade requests whose predicted TTFT misses."""

    enabled: bool = True  # false: every request is admitted (up to server.max_inflight_requests)
    ttft_slack: Annotated[float, Meta(gt=0)] = 1.0  # admit while predicted TTFT <= slack x the route's target
    max_waiting_per_route: PositiveInt = 256  # default for routes without max_waiting
    rate_halflife_s: Annotated[float, Meta(gt=0)] = 10.0  # how fast the measured rates and TTFT stretch forget
    min_rate_observations: PositiveInt = 3  # first tokens seen on an engine before predictions are trusted
    min_retry_after_s: NonNegativeFloat = 1.0
    max_retry_after_s: NonNegativeFloat = 60.0


class CostConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    price_per_device_hour: NonNegativeFloat | None = None  # currency per device-hour; None: no cost gauges


class AutoscaleConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """[autoscale]: targets and hysteresis of the replica recommendation (gateway/autoscale.py Autoscaler)."""

    min_replicas: PositiveInt = 1
    max_replicas: PositiveInt = 8  # also the largest `replicas` a caller of /v1/autoscale may name
    target_waiting_per_replica: Annotated[float, Meta(gt=0)] = 8.0
    target_kv_usage: Fraction = 0.8
    tolerance: NonNegativeFloat = 0.1  # ignore a metric within 10% of its target, as Kubernetes' HPA does
    max_scale_up_step: PositiveInt = 4  # replicas added at most per evaluation (or doubling, whichever is more)
    slo_up_cooldown_s: NonNegativeFloat = 60.0  # an SLO miss adds one replica at most this often (attainment lags)
    down_stabilization_s: NonNegativeFloat = 300.0  # scale down to the highest recommendation of this window
    down_cooldown_s: NonNegativeFloat = 120.0  # no scale-down this soon after any change
    max_scale_down_step: PositiveInt = 1
    # the gateway's own evaluations, the only ones besides POST /v1/autoscale that advance the hysteresis
    evaluation_interval_s: Annotated[float, Meta(gt=0)] = 15.0


class TandemConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    engines: dict[str, EngineConfig]
    routes: dict[str, RouteConfig] = msgspec.field(default_factory=dict)
    kv_pool: KVPoolConfig = msgspec.field(default_factory=KVPoolConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    telemetry: TelemetryConfig = msgspec.field(default_factory=TelemetryConfig)
    admission: AdmissionConfig = msgspec.field(default_factory=AdmissionConfig)
    cost: CostConfig = msgspec.field(default_factory=CostConfig)
    autoscale: AutoscaleConfig = msgspec.field(default_factory=AutoscaleConfig)
    # what one request's preparation may cost: grammar compiles (budgets, workers, cache), tokenising, stalls
    preparation: CompileLimits = msgspec.field(default_factory=CompileLimits)
    source: str = "<memory>"  # where it was loaded from, for messages; not a TOML key users set

    @property
    def device(self) -> str:
        """The one device every engine runs on (cross-checked at load)."""
        devices = {e.device for e in self.engines.values()}
        return devices.pop() if len(devices) == 1 else "auto"


# ---------------------------------------------------------------------------------------------- loading


def read_config_file(path: str | Path | None) -> tuple[Path, dict[str, Any], Path]:
    """(the file, its parsed TOML, the folder its relative paths start from) for `path`, or the embedded default
    when None; ConfigError for a missing file or bad TOML. A file without `[engines]` overlays the embedded
    default (its tables merged into the default's); one with `[engines]` replaces the default whole. The
    embedded default names checkpoints relative to the project root; a user's file relative to itself."""
    file = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    try:
        raw = tomllib.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {file} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {file} is not valid TOML: {exc}") from None
    if path is not None and "engines" not in raw:  # a file that tunes the default, not one that replaces it
        raw = _overlaid(_default_with_absolute_paths(), raw)
    return file, raw, PROJECT_ROOT if path is None else file.resolve().parent


def _default_with_absolute_paths() -> dict[str, Any]:
    """The embedded default's TOML with its paths (relative to the project root) made absolute."""
    raw = tomllib.loads(DEFAULT_CONFIG_PATH.read_text())
    for engine in raw["engines"].values():
        engine["checkpoint"] = _resolve(PROJECT_ROOT, engine["checkpoint"])
    for route in raw.get("routes", {}).values():
        for table, key in (("router", "artifact"), ("cascade", "scorer")):
            if route.get(table, {}).get(key):
                route[table][key] = _resolve(PROJECT_ROOT, route[table][key])
    return raw


def _overlaid(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top`'s tables merged into `base`'s key by key (a value in `top` replaces `base`'s)."""
    out = dict(base)
    for key, value in top.items():
        out[key] = _overlaid(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else value
    return out


def load_config(path: str | Path | None = None, *, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> TandemConfig:
    """Load `path` (default: the embedded default config), apply `TANDEM_*` env overrides, validate."""
    env = os.environ if env is None else env
    if path is None and env.get("TANDEM_CONFIG"):
        path = env["TANDEM_CONFIG"]
    file, raw, base = read_config_file(path)
    applied = apply_env_overrides(raw, env)
    for dotted, value in (overrides or {}).items():
        _set_path(raw, dotted.split("."), value, f"override {dotted}")
    source = str(file) + (f" (with {', '.join(applied)} from the environment)" if applied else "")
    return config_from_dict(raw, base_dir=base, source=source)


def config_from_dict(raw: dict[str, Any], *, base_dir: str | Path = ".", source: str = "<memory>") -> TandemConfig:
    """Validate a plain dict (as TOML gives it) into a TandemConfig; relative paths resolve against base_dir."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the configuration must be a table, found {type(raw).__name__}")
    raw = dict(raw)
    raw.pop("source", None)
    for section in ("engines", "routes"):  # convert per entry so errors can name the entry
        value = raw.get(section)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{source}: {section} = {value!r} is invalid: expected a table of named "
                              f"{section} ([{section}.NAME])")
    if not raw.get("engines"):
        raise ConfigError(f"{source}: engines is empty: configure at least one engine as [engines.NAME] "
                          f"with a checkpoint")
    engines = {name: convert_section(entry, EngineConfig, f"engines.{name}", source)
               for name, entry in raw["engines"].items()}
    routes = {name: convert_section(entry, RouteConfig, f"routes.{name}", source)
              for name, entry in (raw.get("routes") or {}).items()}
    rest = {k: v for k, v in raw.items() if k not in ("engines", "routes")}
    shell = convert_section(rest | {"engines": {}}, TandemConfig, "", source)
    cfg = msgspec.structs.replace(shell, engines=engines, routes=routes, source=source)
    base = Path(base_dir)
    for engine in cfg.engines.values():
        engine.checkpoint = _resolve_checkpoint(base, engine.checkpoint)
    for route in cfg.routes.values():
        if route.router.artifact:
            route.router.artifact = _resolve(base, route.router.artifact)
        if route.router.shadow_labels:
            route.router.shadow_labels = _resolve(base, route.router.shadow_labels)
        if route.router.refit_dir:
            route.router.refit_dir = _resolve(base, route.router.refit_dir)
        if route.cascade.scorer:
            route.cascade.scorer = _resolve(base, route.cascade.scorer)
        if route.cascade.verification_labels:
            route.cascade.verification_labels = _resolve(base, route.cascade.verification_labels)
    if isinstance(cfg.kv_pool.memory_bytes, str):
        cfg.kv_pool.memory_bytes = _parse_size(cfg.kv_pool.memory_bytes, source)
    _cross_check(cfg)
    return cfg


def _resolve_checkpoint(base: Path, value: str) -> str:
    """A path relative to `base` when one exists there (or the value cannot be a Hub id), else the Hub id."""
    from engines.formats.hub import is_hub_id

    local = _resolve(base, value)
    return value if is_hub_id(value) and not Path(local).exists() else local


def _resolve(base: Path, value: str) -> str:
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def _parse_size(text: str, source: str) -> int:
    m = _SIZE.match(text)
    if not m:
        raise ConfigError(f"{source}: kv_pool.memory_bytes = {text!r} is invalid: expected an integer number "
                          f"of bytes or a size such as \"512MiB\" or \"4GB\"")
    value = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])
    if value <= 0:
        raise ConfigError(f"{source}: kv_pool.memory_bytes = {text!r} is invalid: must be positive")
    return value


def _cross_check(cfg: TandemConfig) -> None:
    """Checks that span fields: names that must exist, shapes that depend on the strategy."""
    src = cfg.source
    names = sorted(cfg.engines)
    devices = sorted({e.device for e in cfg.engines.values()})
    if len(devices) > 1:
        raise ConfigError(f"{src}: engines use different devices {devices}: all engines share one device "
                          f"and one KV pool; set the same engines.*.device everywhere")
    for name, engine in cfg.engines.items():
        if not _valid_device(engine.device):
            raise ConfigError(f"{src}: engines.{name}.device = {engine.device!r} is invalid: expected "
                              f"'auto', 'cpu', 'cuda' or 'cuda:N'")
    try:
        check_drafts(cfg.engines)  # the engine's own draft rules, worded for both callers
    except ValueError as exc:
        raise ConfigError(f"{src}: {exc}") from None
    for name, route in cfg.routes.items():
        where = f"routes.{name}"
        if name in cfg.engines:
            raise ConfigError(f"{src}: {where}: route name {name!r} is also an engine name; the model field "
                              f"would be ambiguous, rename one of them")
        if route.strategy not in STRATEGY_NAMES:
            raise ConfigError(f"{src}: {where}.strategy = {route.strategy!r} is invalid: expected one of "
                              f"{', '.join(repr(s) for s in sorted(STRATEGY_NAMES))}")
        for engine in route.engines:
            if engine not in cfg.engines:
                raise ConfigError(f"{src}: {where}.engines contains {engine!r}, an unknown engine; configured "
                                  f"engines: {names}")
        want = 1 if route.strategy == "fixed" else 2
        if len(route.engines) != want:
            shape = "[engine]" if want == 1 else "[small, large]"
            raise ConfigError(f"{src}: {where}.engines = {route.engines!r} is invalid: strategy "
                              f"{route.strategy!r} takes exactly {want} engine(s) as {shape}")
        if want == 2 and route.engines[0] == route.engines[1]:
            raise ConfigError(f"{src}: {where}.engines = {route.engines!r} is invalid: small and large must "
                              f"be different engines")
        if route.router.threshold is not None and route.router.target_large_fraction is not None:
            raise ConfigError(f"{src}: {where}.router sets both threshold and target_large_fraction; set one")
        if route.router.warmup > route.router.window:
            raise ConfigError(f"{src}: {where}.router.warmup = {route.router.warmup} is above its window = "
                              f"{route.router.window}; the window never holds that many scores, lower warmup")
        if route.allow_downgrade and route.strategy == "fixed":
            raise ConfigError(f"{src}: {where}.allow_downgrade = true is invalid for strategy 'fixed': a "
                              f"fixed route has one engine to fall back to")
    scale = cfg.autoscale
    if scale.min_replicas > scale.max_replicas:
        raise ConfigError(f"{src}: autoscale.min_replicas = {scale.min_replicas} is above autoscale.max_replicas "
                          f"= {scale.max_replicas}; raise max_replicas or lower min_replicas")
    adm = cfg.admission
    if adm.min_retry_after_s > adm.max_retry_after_s:
        raise ConfigError(f"{src}: admission.min_retry_after_s = {adm.min_retry_after_s:g} is above "
                          f"admission.max_retry_after_s = {adm.max_retry_after_s:g}")


def _valid_device(device: str) -> bool:
    return device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", device) is not None


# ------------------------------------------------------------------------------------ env overrides

# Shortcuts for the settings operators change most; everything else uses the generic scheme
# TANDEM_<SECTION>__<KEY>[__<KEY>...], e.g. TANDEM_ENGINES__TANDEM_SMALL__DTYPE=bfloat16.
_SHORTCUTS = {
    "TANDEM_API_KEYS": ["auth", "api_keys"],
    "TANDEM_HOST": ["server", "host"],
    "TANDEM_PORT": ["server", "port"],
    "TANDEM_LOG_LEVEL": ["server", "log_level"],
    "TANDEM_RECORD_CONTENT": ["telemetry", "record_content"],
}
_SECTIONS = {f.encode_name for f in msgspec.inspect.type_info(TandemConfig).fields} - {"source"}


def apply_env_overrides(raw: dict[str, Any], env: Mapping[str, str]) -> list[str]:
    """Apply TANDEM_* variables onto the raw TOML dict in place (values parsed as TOML literals)."""
    applied = []
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX):
            continue
        text = env[var]
        if var in _SHORTCUTS:
            path: list[str] = list(_SHORTCUTS[var])
            if var == "TANDEM_API_KEYS":
                value: Any = [k.strip() for k in text.split(",") if k.strip()]
            else:
                value = _parse_env_value(text)
        elif "__" in var:
            path = var[len(ENV_PREFIX):].lower().split("__")
            if path[0] not in _SECTIONS:
                raise ConfigError(f"environment variable {var}: unknown section {path[0]!r}; sections: "
                                  f"{', '.join(sorted(_SECTIONS))}")
            value = _parse_env_value(text)
        else:
            continue  # TANDEM_CONFIG and variables of other tools are not config keys
        _set_path(raw, path, value, f"environment variable {var}")
        applied.append(var)
    return applied


def _parse_env_value(text: str) -> Any:
    """`8001` -> int, `true` -> bool, `["a", "b"]` -> list, anything else stays a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_path(raw: dict[str, Any], path: list[str], value: Any, origin: str) -> None:
    node = raw
    for i, key in enumerate(path):
        if not isinstance(node, dict):
            raise ConfigError(f"{origin}: {'.'.join(path[:i])} is not a table")
        # Engine and route names may contain '-', which environment variable names cannot.
        match = next((k for k in node if _norm(k) == _norm(key)), key)
        if i == len(path) - 1:
            node[match] = value
        else:
            node = node.setdefault(match, {})


def _norm(key: str) -> str:
    return key.lower().replace("-", "_")
