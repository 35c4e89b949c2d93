"""Where the configuration meets the engines: the engine contract built from it (`engine_core_args`), and the
start-up check that every checkpoint and router artifact it names can load (`check_checkpoints`: Hub ids are
downloaded here, GGUF headers and pre-quantised schemes checked) before anything loads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from engines.config import PoolSpec, options_of
from gateway.config import DEFAULT_ROUTER_ARTIFACT, ConfigError, TandemConfig


def engine_core_args(cfg: TandemConfig) -> tuple[list[Any], PoolSpec, str]:
    """The one place config becomes the engine contract: (EngineSpec list, PoolSpec, device)."""
    from engines import EngineSpec

    # Drafts first so an engine's drafter is loaded before the engine that uses it.
    order = sorted(cfg.engines, key=lambda n: cfg.engines[n].draft is not None)
    specs = [EngineSpec(name, cfg.engines[name].checkpoint, **options_of(cfg.engines[name])) for name in order]
    device = cfg.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return specs, cfg.kv_pool, device  # memory_bytes was parsed to an int at load


def _check_quantization_config(cfg: TandemConfig, name: str, folder: Path) -> None:
    """A pre-quantised checkpoint's scheme that tandem does not load fails before anything loads."""
    import json

    from engines.formats.prequant import Scheme, quantization_config
    from engines.model_config import CheckpointError

    try:
        raw = json.loads((folder / "config.json").read_text())
        qc = quantization_config(folder, raw if isinstance(raw, dict) else {})
        if qc is not None:
            Scheme(qc, str(folder / "config.json"))
    except json.JSONDecodeError:
        return  # the loader names the file and the problem
    except CheckpointError as e:
        raise ConfigError(f"{cfg.source}: engines.{name}.checkpoint: {e}") from None


def check_checkpoints(cfg: TandemConfig) -> None:
    """Fail before loading anything when an engine's checkpoint or a router route's artifact is missing."""
    from engines.formats.hub import is_hub_id

    for name, engine in cfg.engines.items():
        folder = Path(engine.checkpoint)
        if is_hub_id(engine.checkpoint) and not folder.exists():
            from engines.formats.hub import download
            from engines.model_config import CheckpointError

            try:  # downloads now (with a progress bar), before anything loads; cached for the engine's load
                snapshot, _ = download(engine.checkpoint, engine.revision)
            except CheckpointError as e:
                raise ConfigError(f"{cfg.source}: engines.{name}.checkpoint: {e}") from None
            _check_quantization_config(cfg, name, snapshot)
            continue
        if folder.suffix.lower() == ".gguf":
            if not folder.is_file():
                raise ConfigError(f"{cfg.source}: engines.{name}.checkpoint = {engine.checkpoint!r}: GGUF file "
                                  "does not exist")
            from engines.formats.gguf import check
            from engines.model_config import CheckpointError

            try:  # the header only: a damaged file or a type tandem cannot load fails before anything loads
                check(folder)
            except CheckpointError as e:
                raise ConfigError(f"{cfg.source}: engines.{name}.checkpoint: {e}") from None
            continue
        if (folder / "config.json").is_file():
            _check_quantization_config(cfg, name, folder)
        if not (folder / "config.json").is_file():
            reason = "does not exist" if not folder.exists() else "has no config.json"
            raise ConfigError(f"{cfg.source}: engines.{name}.checkpoint = {engine.checkpoint!r} {reason}; "
                              f"point it at a Hugging Face model folder, a .gguf file or a Hub id ORG/NAME")
    for name, route in cfg.routes.items():
        if route.strategy != "router":
            continue
        folder = Path(route.router.artifact or DEFAULT_ROUTER_ARTIFACT)
        missing = [f for f in ("router.json", "router.npz") if not (folder / f).is_file()]
        if missing:
            raise ConfigError(f"{cfg.source}: routes.{name}.router.artifact = {str(folder)!r} has no "
                              f"{' or '.join(missing)}; build one with `tandem router train --out {folder}` or "
                              f"point the route at a router folder")


SERVER_RESERVED_CPUS = 1


def default_host_factory(cfg: TandemConfig) -> Callable[[], Any]:
    """What `tandem serve` loads: one EngineCore for every configured engine (a `gateway.state.EngineHost`)."""
    def build() -> Any:
        from engines import EngineCore

        specs, pool, device = engine_core_args(cfg)
        # on the CPU, automatic threads leave one core to the event loop (HTTP, tokenising, streaming): with
        # every core in the engine's kernels, the loop waits for them and TTFT/TPOT grow (docs/configuration.md)
        return EngineCore(specs, pool, device=device, reserve_cpus=SERVER_RESERVED_CPUS,
                          compile_limits=cfg.preparation)
    return build

