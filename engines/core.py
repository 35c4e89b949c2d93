"""`EngineCore` loads every model, carves the one KV pool they share, and runs all engines in one background
thread that owns the device (`LLM` steps it in the caller's thread instead)."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING

import torch

from engines.compile_pool import CompileLimits, CompilePool
from engines.config import EngineSpec, PoolSpec, validate
from engines.engine import ModelEngine
from engines.errors import EngineDeadError, ErrorCode
from engines.kv_layout import kv_layout
from engines.kv_pool import KVGeometry, KVPool
from engines.loaded import LoadedModel, load_model
from kernels import thread_governor

if TYPE_CHECKING:
    from engines.async_engine import AsyncEngine

log = logging.getLogger("tandem.engine")

DEFAULT_NUM_SPECULATIVE_TOKENS = 4  # max k when a spec names a draft engine but no num_speculative_tokens
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# KV storage: a float dtype, int8 (per token-head scales) or fp8 e4m3 (per-tensor scales)
_KV_DTYPES = {**_DTYPES, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _pool_bytes(pool: PoolSpec, engines_: list[tuple[EngineSpec, LoadedModel]], page_bytes: int,
                device: torch.device) -> int:
    if pool.memory_bytes is not None:
        return int(pool.memory_bytes)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * pool.memory_fraction)
    # CPU: room for every engine's full batch at full context, capped at 1 GiB (calloc'd, touched lazily)
    tokens = 0
    for spec, loaded in engines_:
        ctx = min(spec.max_model_len or loaded.model.config.max_position_embeddings,
                  loaded.model.config.max_position_embeddings)
        tokens += spec.max_num_seqs * ctx
    return min(1 << 30, -(-tokens // pool.block_size) * page_bytes)


def cpu_threads(requested: int = 0, reserve: int = 0) -> int:
    """The torch intra-op threads for `requested` (EngineOptions.threads): itself when > 0, else
    $TANDEM_THREADS, else torch's current setting less `reserve` CPUs left to the process's other threads
    (the gateway's event loop: `tandem serve` leaves it one); never more than the CPUs this process may run
    on (more threads than cores only adds contention), never fewer than 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    if requested <= 0:
        env = os.environ.get("TANDEM_THREADS", "")
        if env.isdigit() and int(env) > 0:
            requested = int(env)
        else:
            requested = min(torch.get_num_threads(), cpus - reserve)
    return max(1, min(requested, cpus))


def apply_cpu_threads(requested: int = 0, reserve: int = 0) -> int:
    """Set torch's thread count (`cpu_threads`). Where it is automatic (no `requested`, no $TANDEM_THREADS),
    the C forward's calls take fewer where timing shows a neighbour holds a core (kernels/thread_governor.py);
    an explicit count is kept as given."""
    env = os.environ.get("TANDEM_THREADS", "")
    thread_governor.enable(requested <= 0 and not (env.isdigit() and int(env) > 0))
    n = cpu_threads(requested, reserve)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


class EngineCore:
    """Loads every model, carves ONE KV pool shared by all of them, and steps every engine with work in one
    background thread (`start()` / `shutdown()`). Idle, the thread sleeps on a condition variable."""

    def __init__(self, specs: list[EngineSpec], pool: PoolSpec | None = None, device: str | torch.device = "cpu",
                 reserve_cpus: int = 0, compile_limits: CompileLimits | None = None):
        if not specs:
            raise ValueError("EngineCore needs at least one EngineSpec")
        pool = pool or PoolSpec()
        validate(specs, pool)
        self.device = torch.device(device)
        if self.device.type != "cpu" and any(s.quantization == "w8a8" for s in specs):
            raise ValueError("quantization 'w8a8' runs on the CPU only; use 'int8' on CUDA")
        if self.device.type != "cpu" and any(s.quantization == "bf16" for s in specs):
            raise ValueError("quantization 'bf16' runs on the CPU only; on CUDA use dtype 'bfloat16'")
        if self.device.type == "cpu":
            # reserve_cpus: CPUs the automatic thread count leaves to the caller's other threads (`cpu_threads`)
            self.threads = apply_cpu_threads(max(s.threads for s in specs), reserve_cpus)
        loaded = [(s, load_model(s, self.device)) for s in specs]
        geoms = []
        for spec, lm in loaded:
            cfg = lm.model.config
            dtype = (next(lm.model.parameters()).dtype if pool.kv_cache_dtype == "auto"
                     else _KV_DTYPES[pool.kv_cache_dtype])
            layout = kv_layout(cfg.traits.layer_windows, cfg.num_layers, spec.free_window_pages)
            geoms.append(KVGeometry(layout.layers_per_page, cfg.num_kv_heads, cfg.head_dim, dtype, layout))
        # a block's bytes: a page per page group (engines/kv_layout.py)
        block_bytes = max(g.page_bytes(pool.block_size) for g in geoms) * max(g.num_groups for g in geoms)
        self.pool_spec = pool
        self.pool = KVPool(geoms, _pool_bytes(pool, loaded, block_bytes, self.device), pool.block_size,
                           self.device, pool.enable_prefix_caching)
        self.engines: dict[str, ModelEngine] = {
            s.name: ModelEngine(s, lm, self.pool, i, self.device) for i, (s, lm) in enumerate(loaded)}
        for s in specs:
            if s.draft is not None:
                target, draft = self.engines[s.name], self.engines[s.draft]
                if draft.config.vocab_size != target.config.vocab_size:
                    raise ValueError(f"engine {s.name!r}: draft {s.draft!r} has vocabulary "
                                     f"{draft.config.vocab_size}, the engine {target.config.vocab_size}: a draft "
                                     "model must share the engine's tokenizer")
                k_max = s.num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS
                target.use_drafter(draft, k_max)
        # grammar compiles for every engine, in worker processes started with the first constrained request
        self.compile_pool = CompilePool(compile_limits)
        for e in self.engines.values():
            e.inputs.compile_pool, e.inputs.compile_limits = self.compile_pool, self.compile_pool.limits
        self.step_started: float | None = None  # monotonic start of the step running now (for `stalled`)
        self._async: dict[str, AsyncEngine] = {}
        self._cv = threading.Condition()
        self._stop = False
        self._dead: str | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> EngineCore:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tandem-engine-core", daemon=True)
            self._thread.start()
        return self

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.compile_pool.close()
        self._dead = self._dead or "engine shut down"
        for e in self.engines.values():
            e.fail_all("engine shut down", ErrorCode.ENGINE_DEAD)

    def __enter__(self) -> EngineCore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def engine(self, name: str) -> AsyncEngine:
        from engines.async_engine import AsyncEngine

        if name not in self.engines:
            raise KeyError(f"no engine named {name!r}; have {sorted(self.engines)}")
        if name not in self._async:
            self._async[name] = AsyncEngine(self, self.engines[name])
        return self._async[name]

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._thread is None:
            raise EngineDeadError("EngineCore is not running: call start() before generate()")

    def has_work(self) -> bool:
        return any(e.has_work() for e in self.engines.values())

    def step(self) -> int:
        """Step every engine that has work once (the loop body; `LLM` calls it directly, without a thread)."""
        done = 0
        self.step_started = time.monotonic()
        thread_governor.claim()  # the stepping thread's kernel calls take the threads (kernels/thread_governor.py)
        for e in self.engines.values():
            if e.has_work():
                try:
                    done += e.step()
                except Exception as exc:  # a scheduler-level bug: this engine's requests fail, the loop lives
                    log.exception("engine %s: step failed", e.name)
                    e.fail_all(f"engine error: {type(exc).__name__}: {exc}")
        self.step_started = None
        return done

    def stalled(self, after_s: float) -> str | None:
        """Why this core cannot make progress (its loop died, a step has run over `after_s`, the compile
        pool is stuck), or None; /health reports it."""
        if self._dead is not None and not self._stop:
            return self._dead
        started = self.step_started
        if started is not None and time.monotonic() - started > after_s:
            return f"an engine step has run for {time.monotonic() - started:.0f} s"
        return self.compile_pool.stalled()

    def _loop(self) -> None:
        try:
            while not self._stop:
                if not self.has_work():
                    with self._cv:
                        self._cv.wait_for(lambda: self._stop or self.has_work())
                    continue
                self.step()
        except BaseException as exc:  # never expected: make the failure visible to every caller
            self._dead = f"engine loop crashed: {type(exc).__name__}: {exc}"
            log.exception("engine core loop crashed")
            for e in self.engines.values():
                e.fail_all(self._dead, ErrorCode.ENGINE_DEAD)

    def stats(self) -> dict:
        return {"pool": self.pool.stats(), "engines": {n: e.stats() for n, e in self.engines.items()}}


__all__ = ["EngineCore"]
