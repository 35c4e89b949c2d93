"""The engine's configuration, defined once: `EngineOptions` (how one engine serves its model, with each field's
allowed values), `EngineSpec` (options + a name and the model) and `PoolSpec` (the shared KV pool). The
gateway's `[engines.NAME]` and `[kv_pool]` tables are these Structs (gateway/config.py embeds them);
`validate` applies the same constraints to specs built in Python, and `check_drafts` the cross-field rules."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

PositiveInt = Annotated[int, Meta(ge=1)]
Quantization = Literal["none", "int8", "int4", "w8a8", "bf16"]  # EngineOptions.quantization; the CLI's choices
Fraction = Annotated[float, Meta(gt=0, le=1)]


class EngineOptions(Struct, kw_only=True, forbid_unknown_fields=True):
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    revision: str | None = None  # a Hub id's branch, tag or commit (default: main); refused for local paths
    max_num_seqs: PositiveInt = 64
    max_num_batched_tokens: PositiveInt = 512
    max_model_len: PositiveInt | None = None
    draft: str | None = None  # name of another engine used as this engine's speculative drafter
    num_speculative_tokens: Annotated[int, Meta(ge=0, le=16)] = 0  # max k; 0 with a draft: the default 4
    # applied at load: int8/int4 weight-only (head and embeddings stay float); w8a8 (CPU only) int8 weights and
    # head with activations quantised per 32 values at run time (llama.cpp q8_0's rounding); bf16: bfloat16
    # weights and head with each linear's input rounded to bfloat16 (llama.cpp's BF16 numerics)
    quantization: Quantization = "none"
    quantization_group_size: Literal[32, 64, 128] = 64  # int4 only: weights per scale/zero-point group
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    cuda_graphs: bool = True  # CUDA + Triton attention: decode steps replay graphs captured per batch bucket
    # a model with global and sliding-window layers (Gemma 2/3) keeps them in separate page groups and frees a
    # window layer's pages once its window has passed them (engines/kv_layout.py); False: every layer keeps its
    # KV for the whole sequence
    free_window_pages: bool = True
    # waiting requests by priority then TTFT deadline, batch caps from the running TPOT targets; False: plain
    # (priority, arrival) order under the configured limits only
    slo_scheduling: bool = True
    # seconds of TTFT deadline one priority class is worth (waiting_queue.py): small is close to earliest-
    # deadline-first, which meets the most deadlines when admission keeps them feasible; large starves lower
    # classes for that long under sustained load
    priority_aging_s: Annotated[float, Meta(gt=0)] = 30.0
    # a waiting request past its TTFT deadline (before any token) ends with ErrorCode.TTFT_EXPIRED instead of
    # being served late: it can no longer count as goodput, and serving it delays requests that still can
    drop_expired_requests: bool = False
    # CPU: torch's intra-op threads (and the CPU kernels'); process-wide, so the core applies the largest of
    # its engines' values. 0: $TANDEM_THREADS if set, else torch's default (the physical cores, or
    # $OMP_NUM_THREADS), capped at the CPUs this process may run on
    threads: Annotated[int, Meta(ge=0, le=1024)] = 0


class EngineSpec(EngineOptions, kw_only=False):
    name: str
    # a checkpoint folder, a .gguf file, a Hub id ORG/NAME (str | Path), or a built engines.model.Transformer
    # (token-id prompts only)
    model: Any


class PoolSpec(Struct, kw_only=True, forbid_unknown_fields=True):
    memory_bytes: int | None = None  # None: memory_fraction of free device memory (CUDA) or a sized default (CPU)
    memory_fraction: Fraction = 0.9
    block_size: Annotated[int, Meta(ge=1, le=1024)] = 16
    enable_prefix_caching: bool = True
    # auto: each model's own dtype; int8: per token-head scales; fp8 (e4m3): per-tensor scales
    kv_cache_dtype: Literal["auto", "float16", "bfloat16", "float32", "int8", "fp8"] = "auto"


ENGINE_OPTIONS = EngineOptions.__struct_fields__


def options_of(spec: EngineOptions) -> dict[str, Any]:
    """The `EngineOptions` fields of `spec` (an `EngineSpec` or the gateway's engine table)."""
    return {f: getattr(spec, f) for f in ENGINE_OPTIONS}


def validate(specs: list[EngineSpec], pool: PoolSpec) -> None:
    """The Structs' constraints (which msgspec checks when it decodes a config) for specs built in Python,
    then `check_drafts`; a ValueError names the field and the value."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"engine names must be unique, got {names}")
    for s in specs:
        _convert(options_of(s), EngineOptions, f"engine {s.name!r}: ")
    _convert(msgspec.structs.asdict(pool), PoolSpec, "")
    check_drafts({s.name: s for s in specs})


def check_drafts(engines: Mapping[str, EngineOptions]) -> None:
    """Drafts name another engine, which drafts for nobody itself; num_speculative_tokens needs a draft."""
    names = sorted(engines)
    for name, e in engines.items():
        where = f"engines.{name}"
        if e.draft is not None:
            if e.draft not in engines:
                raise ValueError(f"{where}.draft = {e.draft!r} names an unknown engine: it must name another engine "
                                 f"of this core; configured engines: {names}")
            if e.draft == name:
                raise ValueError(f"{where}.draft = {name!r} is invalid: an engine cannot draft for itself; it must "
                                 "name another engine")
            if engines[e.draft].draft is not None:
                raise ValueError(f"{where}.draft = {e.draft!r} is invalid: the draft engine has a draft of its own; "
                                 "chains are not supported")
        if e.num_speculative_tokens > 0 and e.draft is None:
            raise ValueError(f"{where}.num_speculative_tokens = {e.num_speculative_tokens} needs {where}.draft: it "
                             "needs a draft engine (another engine's name), or set num_speculative_tokens = 0")


def spec_kwargs(options: dict) -> tuple[dict, dict]:
    """Split flat keyword options (as `LLM(**options)` takes them) into EngineSpec and PoolSpec fields."""
    engine_fields = set(EngineSpec.__struct_fields__)
    pool_fields = set(PoolSpec.__struct_fields__)
    unknown = set(options) - engine_fields - pool_fields - {"device"}
    if unknown:
        raise TypeError(f"unknown engine option(s) {sorted(unknown)}; known: "
                        f"{sorted(engine_fields | pool_fields | {'device'})}")
    return ({k: v for k, v in options.items() if k in engine_fields},
            {k: v for k, v in options.items() if k in pool_fields})


def _convert(values: dict[str, Any], kind: type, where: str) -> None:
    try:
        msgspec.convert(values, kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        field = text.rsplit("`$.", 1)[-1].rstrip("`") if "`$." in text else "?"
        allowed = text.split(" - at ")[0]
        info = next((f.type for f in msgspec.inspect.type_info(kind).fields if f.name == field), None)
        if isinstance(info, msgspec.inspect.LiteralType):
            allowed = "use one of " + ", ".join(repr(v) for v in info.values)
        raise ValueError(f"{where}{field}={values.get(field)!r} is invalid: {allowed}") from None
