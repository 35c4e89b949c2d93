"""tandem's CPU kernels: kernels/cpu_kernels.c built with the system C compiler at first use (kernels/cbuild.py:
one `cc -O3 -march=native` call, about a second), cached under `~/.cache/tandem/cpu_kernels` (or
`$TANDEM_CPU_KERNELS_DIR`) by a hash of the source, the flags, the compiler and the CPU, and called through
ctypes. Each kernel has its PyTorch reference here, which the tests compare it to and which runs wherever the
kernels are unavailable (no compiler, no AVX2/FMA, or `TANDEM_CPU_KERNELS=0`). Where -march=native finds
AVX-512 the float32 streams run 16 wide and, with VNNI, the int8 dots take vpdpbusd (`simd_level()`;
`TANDEM_CPU_SIMD=avx2` builds the AVX2 paths alone, to compare).

- `linear(x, weight, bias)`: y = x @ weight.T for a float32 nn.Linear weight stored column-major
  (`engines.model.cpu_weight_layout`): up to 8 rows the weight is streamed once in address order (the decode
  GEMV at the memory's speed), or summed in registers 32 columns at a time (5-8 rows); more rows take those
  tiles 8 rows at a time (over panels: 6 rows x 64 columns, each column pair through every row block while it
  is in L2), or the MKL `SGEMM` torch ships. Which, on large weights and at many rows,
  `calibrate` decides by timing both on the model's weights (it depends on the CPU). `weight16`, a
  `bf16_copy` of a weight whose values are all bfloat16 (a bf16 checkpoint upcast at load), is what the
  register tiles read then: half the bytes, the same bits.
- `linear_packed(x, packed, n, bias)`: the same over the weight packed in panels of 32 columns (`pack_f32`),
  which a pass reads in address order (~1.25x the column-major streams' speed at one row from memory on a Zen 4
  VM): the same bits. `PackedLinear` is the module that keeps a weight only so (kernels/cpu_forward.py swaps the
  decoder's projections for them).
- `linear_int8(x, q, scale, bias)`: weight-only int8 (q [N, K], per-row scale, or a scale per 32 weights as GGUF
  Q8_0 stores them) with float32 activations; many rows widen the weight to float32 once and take the SGEMM too.
- `linear_w8a8(x, q, scale, bias)`: the same weights with the activations quantised per 32 values
  (`kernels.quant_matmul.quantize_act_q8`, llama.cpp's q8_0 rounding): integer dots, for every row count;
  at 3+ rows on AMX int8 tiles where the CPU and Linux allow them (`set_amx()` turns them off to compare).
- `linear_w4a8(x, packed, scale, zero, group, bias)`: int4 weights (kernels.quant_matmul's format, the scales
  as float32) with the activations quantised as for w8a8: one vpmaddubsw per 32 weights, the zero points
  subtracted through each block's sum.
- `linear_bf16(x, packed, n, bias)`: bfloat16 weights (`pack_bf16_pairs`: panels of 16 columns of (k, k + 1)
  pairs) with the activations rounded to bfloat16 (llama.cpp's BF16 numerics; `quantization = "bf16"`): the
  products exact, the sums float32; vdpbf16ps where the CPU has AVX512-BF16 (`tk_has_bf16_dots`), float32 FMAs
  elsewhere.
- `paged_attention(...)`: attention over float32 KV pages read in place, for decode, verify windows and
  prefill chunks alike (the queries of a sequence are the last q_len of its context, causal); `write_kv`.
- `rope_(...)`: RoPE in place on the q/k columns of a fused projection, bit-identical to torch's ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import platform
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import hugepages, thread_governor
from kernels.cbuild import NoCompiler, build_library
from kernels.quant_formats import dequantize_int4, dequantize_int8, quantize_act_q8, unpack_zero

_SRC = Path(__file__).with_name("cpu_kernels.c")
_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-fno-math-errno"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
build_error: str | None = None  # why the kernels are unavailable, once `load()` has tried

_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SGEMM_MIN_ROWS = 13  # kernels/cpu_kernels.c's built-in threshold
SCALE_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # tk_linear_w4a8's skind
BLOCK_MAX_KN = 1 << 20  # and the register blocks' built-in bound (floats)
BLOCK_MAX_K, BLOCK_MIN_ROWS = 1024, 5  # their built-in longest column, and the fewest rows they take
CALIBRATION_BYTES = 256 << 20  # `calibrate` times passes over at most about this many bytes of weights


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CPU_KERNELS_DIR") or Path.home() / ".cache" / "tandem" / "cpu_kernels")


_SIMD_FLAGS = {"avx2": ["-mno-avx512f"], "native": []}  # the builds `build_variant` and TANDEM_CPU_SIMD name


def _simd_flags() -> list[str]:
    """`TANDEM_CPU_SIMD=avx2` builds without AVX-512 on a machine that has it (to compare the two paths);
    anything else takes what -march=native finds."""
    return _SIMD_FLAGS["avx2"] if os.environ.get("TANDEM_CPU_SIMD", "").lower() == "avx2" else []


def build_variant(simd: str, source: str | None = None, stem: str | None = None, openmp: bool = False
                  ) -> ctypes.CDLL:
    """A separately built copy of the kernels: `simd` "avx2" (no AVX-512) or "native" (what -march=native
    finds), to compare the SIMD paths in one process (tests, benchmarks); `source` another C source in place of
    kernels/cpu_kernels.c (bench/kernel_ab.py's A/B of two revisions), `stem` its library's name, `openmp` built
    with its threads. Raises where it cannot be built."""
    so = build_library(_SRC.read_text() if source is None else source, stem or f"tandem_cpu_kernels_{simd}",
                       [*_FLAGS, *_SIMD_FLAGS[simd], "-fopenmp" if openmp else "-Wno-unknown-pragmas"],
                       cache_dir(), key=(_cpu_flags(),))
    return _bind(ctypes.CDLL(str(so)))


def simd_level() -> str:
    """The SIMD paths the loaded kernels run: "avx512-vnni", "avx512", "avx2", or "none" (not loaded)."""
    lib = load()
    return "none" if lib is None else ("none", "avx2", "avx512", "avx512-vnni")[lib.tk_simd_level()]


def set_amx(on: bool | None = None, lib: ctypes.CDLL | None = None) -> bool:
    """Whether w8a8 multiplies on AMX tiles at 2+ rows; `on` turns them on or off (to compare both paths).
    False where the build or the kernel has no AMX, or the kernels are not loaded."""
    lib = lib or load()
    return lib is not None and bool(lib.tk_set_amx(-1 if on is None else int(on)))


def _knob(name: str, value: int | None, lib: ctypes.CDLL | None) -> int:
    """One of the C side's int64 settings (`tk_<name>(v)`: v >= 0 sets it, -1 only asks); 0 without kernels."""
    lib = lib or load()
    return 0 if lib is None else int(getattr(lib, "tk_" + name)(-1 if value is None else int(value)))


def block_max_kn(value: int | None = None, lib: ctypes.CDLL | None = None) -> int:
    """The largest float32 weight (K * N floats) that `linear`'s 5-8-row register blocks take (larger ones are
    streamed in address order); `value` sets it. The same bits either way. 0 where the kernels are not loaded."""
    return _knob("block_max_kn", value, lib)


def block_max_k(value: int | None = None, lib: ctypes.CDLL | None = None) -> int:
    """The longest column (K) the register blocks take a weight with (BLOCK_MAX_K unless `calibrate` lifted it);
    `value` sets it. The same bits either way. 0 where the kernels are not loaded."""
    return _knob("block_max_k", value, lib)


def block_min_rows(value: int | None = None, lib: ctypes.CDLL | None = None) -> int:
    """The fewest rows from which the register blocks take a float32 weight above their built-in bounds (a
    weight from memory; within the bounds they take 5-8 rows); `value` sets it. The same bits either way."""
    return _knob("block_min_rows", value, lib)


def stream_pf(value: int | None = None, lib: ctypes.CDLL | None = None) -> int:
    """How many rows of k ahead the float32 streams prefetch (0: no prefetch instructions); `value` sets it.
    The same bits either way. 0 where the kernels are not loaded."""
    return _knob("stream_pf", value, lib)


def one_row(value: int | None = None, lib: ctypes.CDLL | None = None) -> int:
    """1 (default): w8a8, int4 and bf16 over one activation row read the weight rows (panels) one after another
    in address order; 0: the tiles over four at a time. The same bits either way. 0 where the kernels are not
    loaded."""
    return _knob("one_row", value, lib)


def sgemm_min_rows(value: int | None = None, lib: ctypes.CDLL | None = None) -> int:
    """The fewest rows `linear` hands to the MKL SGEMM (fewer take the register tiles, 8 rows at a time);
    `value` sets it (`NEVER`: the tiles at every row count). 0 where the kernels are not loaded."""
    return _knob("sgemm_min_rows", value, lib)


NEVER = 1 << 62
CALIBRATION_ROWS = (16, 64, 256)  # where `calibrate` weighs the SGEMM against the tiles
_calibration: dict | None = None  # `calibrate`'s choices, once per process
log = logging.getLogger("tandem.kernels")


STREAM_PF = 4  # the streams' built-in prefetch distance (rows of k); `calibrate` weighs STREAM_PF_CHOICES
STREAM_PF_CHOICES = (4, 2, 0)


def _best_pass(lib: ctypes.CDLL, weights: list[torch.Tensor], rows: int, settings: dict[str, dict[str, int]],
               reps: int) -> dict[str, float]:
    """Seconds of one pass of `linear` over `weights` (or `linear_packed`, over weights packed in panels) at
    `rows` rows under each setting (the C side's knobs by name: `tk_<name>(value)`), alternated, best of `reps`
    rounds after one that warms up."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}  # K: [N, K] or panels [P, K, 32]
    best = dict.fromkeys(settings, float("inf"))
    for rnd in range(reps + 1):
        for name, knobs in settings.items():
            for k, v in knobs.items():
                getattr(lib, "tk_" + k)(v)
            t = time.perf_counter()
            for w in weights:
                if w.dim() == 3:  # packed in panels (`pack_f32`): `linear_packed`
                    linear_packed(xs[w.shape[1]], w, w.shape[0] * PANEL)
                else:
                    linear(xs[w.shape[1]], w)
            if rnd:
                best[name] = min(best[name], time.perf_counter() - t)
    return best


def calibrate(weights: list[torch.Tensor], reps: int = 3) -> dict | None:
    """Choices of `linear`'s path that give the same answers and whose speed depends on the machine, made by
    timing them on `weights` (a model's own float32 weights, column-major [N, K]), once per process:

    - few rows on weights above the blocks' built-in bounds (4 MiB, or K > 1024: weights from memory): the
      register blocks or the streams. The blocks' strided reads from memory lose to address-order reads on some
      machines and win on others (docs/benchmark_log.md; on a Zen 4 VM 1.4-1.5x at 5-8 rows over 463 MB of
      weights with K 1280-3520); one pass over those weights (up to CALIBRATION_BYTES of them) at 8 rows each
      way, and where the blocks win there, at 3 and then 4 rows, the fewest rows from which they take such
      weights (5 unless they win at 3 or 4); and at one row, how far ahead the streams prefetch (4, 2 or 0
      rows of k: 4 unless another is 3% faster). The same bits either way.
    - Many rows: the MKL SGEMM from 13 rows, or the register tiles (over panels: 6 rows x 64 columns). MKL
      takes its fast paths on some CPUs only; at each of CALIBRATION_ROWS, over one weight of each shape packed
      in panels, the SGEMM keeps the row counts from the first where it is faster (on a Zen 4 VM it never is:
      at 16 / 32 / 64 rows the tiles 91 / 102 / 107 GFLOP/s on one core, the SGEMM 54 / 71 / 85,
      bench/cpu_w8a8_rows.py).

    Each choice is made once per process, by the first model whose weights can make it, and remembered on disk
    for this kernel build, CPU and those weights' shapes (`cache_dir()`; a later process, a restart of the same
    server, reads it instead of timing again: ~55 ms of start-up on the tiny pair; `TANDEM_CPU_CALIBRATE=fresh`
    times again and rewrites it). A choice changes only for a clear 3% gain. Returns the choices ({"blocks":
    "blocks" | "streams" | None, "block_min_rows": n, "stream_pf": n, "sgemm_min_rows": n, and the milliseconds
    measured}), None where the kernels are not loaded or `TANDEM_CPU_CALIBRATE=0` keeps the built-in choices."""
    global _calibration
    lib = load()
    if lib is None or os.environ.get("TANDEM_CPU_CALIBRATE", "1") == "0":
        return _calibration
    with _lock:
        out = _calibration or {"blocks": None, "block_min_rows": None, "stream_pf": None, "sgemm_min_rows": None,
                               "ms": {}}
        f32 = [w for w in weights if w.dim() == 2 and linear_fits(torch.empty(1, 1), w)]
        # each choice once per process, on the first model that can make it (a draft built first has no
        # weight above the bounds: the blocks' choice waits for a model that has)
        big, size = [], 0
        for w in f32:
            if (w.numel() > BLOCK_MAX_KN or w.shape[1] > BLOCK_MAX_K) and size < CALIBRATION_BYTES:
                big.append(w)
                size += 4 * w.numel()
        made = []
        if out["blocks"] is None and big:
            made.append(_remembered(lib, "blocks", big, lambda: _time_blocks(lib, big, reps)))
        one = list({tuple(w.shape): w for w in f32 if w.numel() <= 1 << 24}.values())  # one weight per shape
        if out["sgemm_min_rows"] is None and one:
            made.append(_remembered(lib, "sgemm", one, lambda: _time_sgemm(lib, one, reps)))
        for choice in made:
            out["ms"].update(choice.pop("ms"))
            out.update(choice)
        if out["blocks"] is not None:
            blocks = out["blocks"] == "blocks"
            lib.tk_block_max_kn(NEVER if blocks else BLOCK_MAX_KN)
            lib.tk_block_max_k(NEVER if blocks else BLOCK_MAX_K)
            lib.tk_block_min_rows(out["block_min_rows"])
            lib.tk_stream_pf(out["stream_pf"])
        if out["sgemm_min_rows"] is not None:
            lib.tk_sgemm_min_rows(out["sgemm_min_rows"])
        _calibration = out
    if made:
        log.info("cpu kernels calibrated: passes over weights above %d MiB or K %d on the %s (from %s rows); the "
                 "MKL SGEMM %s (ms: %s)", BLOCK_MAX_KN * 4 >> 20, BLOCK_MAX_K, out["blocks"] or "(none measured yet)",
                 out["block_min_rows"], "never" if out["sgemm_min_rows"] == NEVER
                 else f"from {out['sgemm_min_rows']} rows", out["ms"])
    return out


def _time_blocks(lib: ctypes.CDLL, big: list[torch.Tensor], reps: int) -> dict:
    """The blocks' choice over weights from memory: blocks or streams at 8 rows, the fewest rows the blocks take,
    the streams' prefetch distance at one row."""
    ms: dict[str, dict[str, float]] = {}
    streams = {"block_max_kn": BLOCK_MAX_KN, "block_max_k": BLOCK_MAX_K, "block_min_rows": BLOCK_MIN_ROWS}
    blocks = {"block_max_kn": NEVER, "block_max_k": NEVER, "block_min_rows": BLOCK_MIN_ROWS}
    t = _best_pass(lib, big, 8, {"streams": streams, "blocks": blocks}, reps)
    choice = "blocks" if t["blocks"] < 0.97 * t["streams"] else "streams"
    ms["8 rows above the bound"] = {k: round(v * 1e3, 3) for k, v in t.items()}
    min_rows = BLOCK_MIN_ROWS
    if choice == "blocks":
        for rows in (3, 4):  # fewer rows: the blocks where they win there too
            t = _best_pass(lib, big, rows, {"streams": blocks, "blocks": {**blocks, "block_min_rows": rows}}, reps)
            ms[f"{rows} rows above the bound"] = {k: round(v * 1e3, 3) for k, v in t.items()}
            if t["blocks"] < 0.97 * t["streams"]:
                min_rows = rows
                break
    for k, v in (blocks if choice == "blocks" else streams).items():
        getattr(lib, "tk_" + k)(v)
    lib.tk_block_min_rows(min_rows)
    # one row (the streams whatever the blocks' choice): how far ahead they prefetch
    t = _best_pass(lib, big, 1, {f"{d} ahead": {"stream_pf": d} for d in STREAM_PF_CHOICES}, reps)
    ms["1 row above the bound"] = {k: round(v * 1e3, 3) for k, v in t.items()}
    best = min(STREAM_PF_CHOICES, key=lambda d: t[f"{d} ahead"])
    pf = best if t[f"{best} ahead"] < 0.97 * t[f"{STREAM_PF} ahead"] else STREAM_PF
    return {"blocks": choice, "block_min_rows": min_rows, "stream_pf": pf, "ms": ms}


def _time_sgemm(lib: ctypes.CDLL, one: list[torch.Tensor], reps: int) -> dict:
    """From how many rows the MKL SGEMM takes over from the register tiles (NEVER: it never wins), timed on the
    weights packed in panels as the C decoder stack holds them (there more than 8 rows take the 6-row x 64-column
    tiles, every row block over a column pair while it is in L2)."""
    ms: dict[str, dict[str, float]] = {}
    rows_from = lib.tk_sgemm_min_rows(-1)
    if sgemm_address() is not None:
        one = [pack_f32(w) for w in one if w.shape[0] % PANEL == 0] or one
        rows_from = NEVER
        for rows in CALIBRATION_ROWS:
            t = _best_pass(lib, one, rows, {"tiles": {"sgemm_min_rows": NEVER}, "sgemm": {"sgemm_min_rows": 1}},
                           reps)
            ms[f"{rows} rows"] = {k: round(v * 1e3, 3) for k, v in t.items()}
            if t["sgemm"] < 0.97 * t["tiles"]:
                rows_from = SGEMM_MIN_ROWS if rows == CALIBRATION_ROWS[0] else rows
                break
    return {"sgemm_min_rows": rows_from, "ms": ms}


def _remembered(lib: ctypes.CDLL, choice: str, weights: list[torch.Tensor], measure: Callable[[], dict]) -> dict:
    """`measure()`'s result for `choice` on this kernel build (its file name holds the source, flags and CPU
    flags' hash), this machine's CPU model and memory, and these weight shapes: read from the file an earlier
    process wrote, else measured now and written (TANDEM_CPU_CALIBRATE=fresh: always measured)."""
    machine = (platform.processor(), _cpu_model(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
               os.cpu_count())
    shapes = sorted(tuple(w.shape) for w in weights)
    key = hashlib.sha256(repr((choice, Path(lib._name).name, machine, shapes)).encode()).hexdigest()[:20]
    path = cache_dir() / f"calibration-{choice}-{key}.json"
    if os.environ.get("TANDEM_CPU_CALIBRATE") != "fresh":
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    result = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache: measured again next time
        log.debug("calibration not remembered in %s: %s", path, exc)
    return result


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line
    except OSError:
        pass
    return ""


def calibration() -> dict | None:
    """`calibrate`'s choices in this process, or None before it ran."""
    return _calibration


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.tk_has_avx2.restype = _INT
    lib.tk_simd_level.restype = _INT
    lib.tk_linear_f32.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _INT]
    lib.tk_linear_f32.restype = None
    lib.tk_linear_f32_w16.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _INT]
    lib.tk_linear_f32_w16.restype = None
    lib.tk_linear_f32_panels.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _INT]
    lib.tk_linear_f32_panels.restype = _INT
    lib.tk_linear_i8.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _INT]
    lib.tk_linear_i8.restype = None
    lib.tk_linear_w8a8.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _INT]
    lib.tk_linear_w8a8.restype = _INT
    for fn in (lib.tk_linear_i8g, lib.tk_linear_w8a8g):  # scale [N, K / 32]
        fn.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _INT]
        fn.restype = _INT
    lib.tk_linear_w4a8.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR, _INT]
    lib.tk_linear_w4a8.restype = _INT
    lib.tk_quant_act_q8.argtypes = [_PTR, _I64, _I64, _PTR, _PTR]
    lib.tk_quant_act_q8.restype = None
    lib.tk_linear_bf16.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _INT]
    lib.tk_linear_bf16.restype = _INT
    lib.tk_round_bf16.argtypes = [_PTR, _I64, _I64, _PTR]
    lib.tk_round_bf16.restype = None
    lib.tk_has_bf16_dots.restype = _INT
    lib.tk_paged_attention_f32.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _I64,
                                           _PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _PTR, _INT, _I64]
    lib.tk_paged_attention_f32.restype = _INT
    lib.tk_write_kv_f32.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64]
    lib.tk_write_kv_f32.restype = None
    if hasattr(lib, "tk_kv_kinds"):  # (not in builds of sources before it: bench/kernel_ab.py's bases)
        lib.tk_kv_kinds.restype = _I64
    lib.tk_rope_f32.argtypes = [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR]
    lib.tk_rope_f32.restype = None
    for fn in (lib.tk_block_max_kn, lib.tk_block_max_k, lib.tk_block_min_rows, lib.tk_sgemm_min_rows,
               lib.tk_stream_pf, lib.tk_split_per_thread, lib.tk_w8_many_rows, lib.tk_one_row):
        fn.argtypes = [_I64]
        fn.restype = _I64
    lib.tk_set_amx.argtypes = [_INT]
    lib.tk_set_amx.restype = _INT
    lib.tk_set_sgemm.argtypes = [_PTR]
    lib.tk_set_sgemm.restype = None
    lib.tk_set_sgemm(sgemm_address())  # many-row linears: the MKL SGEMM torch ships, where it exports one
    if os.environ.get("TANDEM_CPU_SPLIT"):  # chunks a thread of the quantised / bf16 linears (cpu_kernels.c)
        lib.tk_split_per_thread(int(os.environ["TANDEM_CPU_SPLIT"]))
    return lib


def sgemm_address() -> int | None:
    """The address of `SGEMM` (Fortran ABI, 32-bit ints) in the MKL linked into torch, or None."""
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        fn = ctypes.CDLL(str(path)).SGEMM
    except (OSError, AttributeError):
        return None
    return ctypes.cast(fn, ctypes.c_void_p).value


def load() -> ctypes.CDLL | None:
    """The built library, or None (reason in `build_error`). Builds once per process and machine."""
    global _lib, _tried, build_error
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            _lib = _load()
        except Exception as exc:  # no compiler, a failed build, an unloadable library: the torch paths serve
            build_error = f"{type(exc).__name__}: {exc}"
            _lib = None
        _tried = True
    return _lib


def _load() -> ctypes.CDLL | None:
    global build_error
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        build_error = "disabled by TANDEM_CPU_KERNELS=0"
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        build_error = f"no AVX2 kernels for {platform.machine()}"
        return None
    lib = None
    source = _SRC.read_text()
    for openmp in (True, False):
        flags = [*_FLAGS, *_simd_flags(), *(["-fopenmp"] if openmp else ["-Wno-unknown-pragmas"])]
        try:
            lib = _bind(ctypes.CDLL(str(build_library(source, "tandem_cpu_kernels", flags, cache_dir(),
                                                      key=(_cpu_flags(),)))))
            break
        except NoCompiler as exc:
            build_error = str(exc)
            return None
        except (OSError, subprocess.SubprocessError) as exc:
            build_error = f"{type(exc).__name__}: {getattr(exc, 'stderr', b'') or exc}"
    if lib is None:
        return None
    if not lib.tk_has_avx2():
        build_error = "the CPU has no AVX2/FMA: the torch paths are faster than the scalar build"
        return None
    build_error = None
    return lib


def available() -> bool:
    return load() is not None


def _threads() -> int:
    return thread_governor.threads()


# ---- linear --------------------------------------------------------------------------------------------------


def linear_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes this call: float32 on the CPU, a 2-D x, a column-major weight [N, K]."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.dim() == 2
            and x.device.type == "cpu" and weight.stride(0) == 1 and weight.dim() == 2)


PANEL = 32  # output columns per panel of the packed weights (cpu_kernels.c, "the weight in panels")


def _panels(weight: torch.Tensor, dtype: torch.dtype, halves: bool) -> torch.Tensor:
    """`weight` [N, K] (any strides) as `dtype` in panels [ceil(N / 32), K, 32] on huge pages, columns past N zero;
    `halves`: a row's word 2i is column i and word 2i + 1 column 16 + i (the bf16 copy's order)."""
    n, k = weight.shape
    panels = (n + PANEL - 1) // PANEL
    if n % PANEL:
        padded = torch.zeros(panels * PANEL, k, dtype=dtype)
        padded[:n] = weight.detach()
    else:
        padded = weight.detach().to(dtype)
    if halves:  # column 32p + 16h + i -> [p, k, i, h]
        return hugepages.copy(padded.view(panels, 2, PANEL // 2, k).permute(0, 3, 2, 1)).view(panels, k, PANEL)
    return hugepages.copy(padded.view(panels, PANEL, k).permute(0, 2, 1))


def pack_f32(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] (any strides) as float32 packed for `linear_packed`: [ceil(N / 32), K, 32], panel p holding
    columns 32p..32p+31 of every k in turn (a one-row pass reads it in address order); columns past N zero."""
    return _panels(weight, torch.float32, halves=False)


def unpack_f32(packed: torch.Tensor, n: int) -> torch.Tensor:
    """`pack_f32`'s inverse: the [N, K] weight (a copy)."""
    panels, k, _ = packed.shape
    return packed.permute(0, 2, 1).reshape(panels * PANEL, k)[:n]


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] (any strides) as bfloat16 packed for the register tiles: [ceil(N / 32), K, 32], panel p
    holding columns 32p..32p+31 of every k in turn, word 2i of a row column 32p + i and word 2i + 1 column
    32p + 16 + i; columns past N zero."""
    return _panels(weight, torch.bfloat16, halves=True)


def unpack_bf16(packed: torch.Tensor, n: int) -> torch.Tensor:
    """`pack_bf16`'s inverse: the [N, K] bfloat16 weight."""
    panels, k, _ = packed.shape
    return packed.view(panels, k, PANEL // 2, 2).permute(0, 3, 2, 1).reshape(panels * PANEL, k)[:n]


def bf16_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The float32 `weight` [N, K] as bfloat16, packed in panels (`pack_bf16`), for `linear`'s register tiles to
    read half the bytes in address order with the same bits out, where every value is exactly a bfloat16 (a bf16
    checkpoint upcast at load); None where one is not, or with `TANDEM_CPU_BF16_WEIGHTS=0`."""
    if os.environ.get("TANDEM_CPU_BF16_WEIGHTS", "1") == "0" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    weight = weight.detach()
    if not torch.equal(weight.bfloat16().float(), weight):
        return None
    return pack_bf16(weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight16: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 @ weight.T (+ bias): weight [N, K] column-major (weight.t() contiguous); `weight16` its
    `bf16_copy` (packed in panels), which the register tiles read instead (the SGEMM reads `weight`)."""
    lib = load()
    if lib is None:
        return F.linear(x, weight, bias)
    if weight16 is not None and (weight16.dtype != torch.bfloat16 or not weight16.is_contiguous() or tuple(
            weight16.shape) != ((weight.shape[0] + PANEL - 1) // PANEL, weight.shape[1], PANEL)):
        raise ValueError("linear: weight16 must be weight's bfloat16 copy packed in panels (bf16_copy)")
    if not x.is_contiguous():
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    lib.tk_linear_f32_w16(x.data_ptr(), m, k, weight.data_ptr(), None if weight16 is None else weight16.data_ptr(),
                          weight.stride(1), n, None if bias is None else bias.data_ptr(), y.data_ptr(), _threads())
    return y


def linear_packed(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
                  weight16: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` over the weight packed in panels (`pack_f32`, n its output columns): the same bits as `linear`
    over the [N, K] weight, which no longer needs to exist (the SGEMM, where it takes the rows, unpacks strips
    of it as it goes)."""
    lib = load()
    if lib is None:
        return F.linear(x, unpack_f32(packed, n), bias)
    panels = (n + PANEL - 1) // PANEL
    if packed.dtype != torch.float32 or not packed.is_contiguous() or packed.dim() != 3 or (
            packed.shape[0], packed.shape[2]) != (panels, PANEL):
        raise ValueError("linear_packed: packed must be a float32 weight packed in panels (pack_f32)")
    if weight16 is not None and (weight16.dtype != torch.bfloat16 or weight16.shape != packed.shape
                                 or not weight16.is_contiguous()):
        raise ValueError("linear_packed: weight16 must be the weight's bfloat16 copy packed in panels (bf16_copy)")
    if not x.is_contiguous():
        x = x.contiguous()
    m, k = x.shape
    y = torch.empty((m, n), dtype=torch.float32)
    if lib.tk_linear_f32_panels(x.data_ptr(), m, k, packed.data_ptr(), _ptr(weight16), n, _ptr(bias), y.data_ptr(),
                                _threads()):
        raise MemoryError("linear_packed: the SGEMM's scratch allocation failed")
    return y


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class PackedLinear(torch.nn.Module):
    """A float32 `nn.Linear` whose weight is kept only packed in panels (`pack_f32`; kernels/cpu_forward.py swaps
    the decoder's projections for these): `forward` is `linear_packed`, `weight` an unpacked copy for whatever
    reads the [N, K] weight (the lean draft runner, tests)."""

    def __init__(self, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.packed = torch.nn.Parameter(packed, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.in_features, self.out_features = packed.shape[1], out_features

    @property
    def weight(self) -> torch.Tensor:
        return unpack_f32(self.packed.detach(), self.out_features).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear_packed(x.reshape(-1, self.in_features).float(), self.packed.detach(), self.out_features,
                          None if self.bias is None else self.bias.detach())
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


def linear_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """x [M, K] float32 @ (q [N, K] int8 * scale).T (+ bias), accumulated in float32: scale float32 [N], or
    [N, K / 32] (a scale per block of 32 weights, GGUF Q8_0's)."""
    lib = load()
    if lib is None:
        return linear_int8_ref(x, q, scale, bias)
    q, scale = q.contiguous(), _int8_scale(scale)
    fn = lib.tk_linear_i8g if scale.dim() == 2 else lib.tk_linear_i8  # (tk_linear_i8 returns nothing)
    return _quant_linear(fn, "int8", x, q.shape[0], bias, q.data_ptr(), scale.data_ptr())


def _int8_scale(scale: torch.Tensor) -> torch.Tensor:
    """The scales as the int8 kernels read them: float32 per channel [N]; per 32 weights [N, K / 32] float16 (GGUF
    Q8_0's own, kept as stored; other dtypes are rounded to float16 here)."""
    return (scale.half() if scale.dim() == 2 else scale.float()).contiguous()


def _quant_linear(fn, name: str, x: torch.Tensor, n: int, bias: torch.Tensor | None, *weights: int
                  ) -> torch.Tensor:
    """y [M, n] = fn(x, M, K, *weights, n, bias, y, threads) for the kernels' quantised linears (the callers keep
    the weight tensors alive); a return code 2 is a shape the kernel does not take, 1 a failed allocation."""
    x = x.contiguous().float()
    m, k = x.shape
    y = torch.empty((m, n), dtype=torch.float32)
    b = None if bias is None else bias.float().contiguous()
    rc = fn(x.data_ptr(), m, k, *weights, n, None if b is None else b.data_ptr(), y.data_ptr(), _threads())
    if rc == 2:
        raise ValueError(f"{name}: in_features {k} does not fit the kernel (w8a8, grouped int8: a multiple of 32; "
                         "int4: of the group, which must be 64 or 128)")
    if rc:
        raise MemoryError(f"{name} linear: scratch allocation failed")
    return y


def linear_w8a8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """x [M, K] float32 (K % 32 == 0) with its rows quantised per 32 values, @ (q [N, K] int8 * scale).T
    (+ bias): int8 dots, each block's sum scaled by its activation scale (and, with scale [N, K / 32], by its
    weight block's), accumulated in float32."""
    lib = load()
    if lib is None:
        return linear_w8a8_ref(x, q, scale, bias)
    q, scale = q.contiguous(), _int8_scale(scale)
    fn = lib.tk_linear_w8a8g if scale.dim() == 2 else lib.tk_linear_w8a8
    return _quant_linear(fn, "w8a8", x, q.shape[0], bias, q.data_ptr(), scale.data_ptr())


def linear_w4a8(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int,
                bias: torch.Tensor | None = None, zero_offset: int = 0) -> torch.Tensor:
    """x [M, K] float32, its rows quantised per 32 values, @ the int4 weight.T (+ bias): packed uint8 [N, K / 2],
    scale [N, K / group] float32, float16 or bfloat16 as stored (the kernel reads that type: no widened copy),
    zero packed two per byte (`quant_formats.pack_zero`: uint8 [N, ceil(G / 2)], + zero_offset) or None (8)."""
    lib = load()
    if lib is None:
        return linear_w4a8_ref(x, packed, scale, zero, bias, zero_offset)
    packed, scale = packed.contiguous(), scale.contiguous() if scale.dtype in SCALE_KINDS else scale.float().contiguous()
    zero = None if zero is None else zero.contiguous()
    return _quant_linear(lib.tk_linear_w4a8, "int4", x, packed.shape[0], bias, packed.data_ptr(), scale.data_ptr(),
                         SCALE_KINDS[scale.dtype], None if zero is None else zero.data_ptr(), zero_offset, group)


def linear_w4a8_ref(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                    bias: torch.Tensor | None = None, zero_offset: int = 0) -> torch.Tensor:
    xq, d = quantize_act_q8(x)
    m, k = x.shape
    xd = (xq.float().view(m, k // 32, 32) * d[..., None]).view(m, k)
    z = unpack_zero(zero, scale.shape[1], zero_offset, rows=packed.shape[0])
    return F.linear(xd, dequantize_int4(packed, scale, z), None if bias is None else bias.float())


def quant_act_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The C kernels' activation quantisation (for the tests): (int8 [M, K], float32 scales [M, K / 32])."""
    x = x.contiguous().float()
    m, k = x.shape
    xq = torch.empty((m, k), dtype=torch.int8)
    d = torch.empty((m, k // 32), dtype=torch.float32)
    load().tk_quant_act_q8(x.data_ptr(), m, k, xq.data_ptr(), d.data_ptr())
    return xq, d


def linear_w8a8_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> torch.Tensor:
    xq, d = quantize_act_q8(x)
    m, k = x.shape
    xd = (xq.float().view(m, k // 32, 32) * d[..., None]).view(m, k)
    return F.linear(xd, dequantize_int8(q, scale), None if bias is None else bias.float())


def linear_int8_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> torch.Tensor:
    return F.linear(x.float(), dequantize_int8(q, scale), None if bias is None else bias.float())


# ---- bfloat16 weights, bfloat16 activations -------------------------------------------------------------------

PAIR_PANEL = 16  # output columns per pair panel (cpu_kernels.c, "bfloat16 weights with bfloat16 activations")


def pack_bf16_pairs(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] (any strides, any float dtype) rounded to bfloat16 and packed for `linear_bf16`:
    [ceil(N / 16), ceil(K / 2), 32] on huge pages, word 2c + h of row j in panel p the weight of column 16p + c
    at k = 2j + h; zeros past N and past K. Stacking whole panels (N a multiple of 16) along the first dimension
    packs the stacked weight."""
    n, k = weight.shape
    panels, kh = (n + PAIR_PANEL - 1) // PAIR_PANEL, (k + 1) // 2
    padded = torch.zeros(panels * PAIR_PANEL, kh * 2, dtype=torch.bfloat16)
    padded[:n, :k] = weight.detach()
    return hugepages.copy(padded.view(panels, PAIR_PANEL, kh, 2).permute(0, 2, 1, 3)).view(panels, kh, 2 * PAIR_PANEL)


def unpack_bf16_pairs(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """`pack_bf16_pairs`' inverse: the [N, K] bfloat16 weight (a copy)."""
    panels, kh, _ = packed.shape
    return packed.view(panels, kh, PAIR_PANEL, 2).permute(0, 2, 1, 3).reshape(panels * PAIR_PANEL, kh * 2)[:n, :k]


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bfloat16 as `linear_bf16` rounds its activations: to nearest even, a subnormal to a signed
    zero (vcvtneps2bf16's)."""
    x = x.float()
    return torch.where(x.abs() < torch.finfo(torch.float32).tiny, x * 0, x).bfloat16()


def linear_bf16(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 rounded to bfloat16 @ the bfloat16 weight (`pack_bf16_pairs`, n output columns).T
    (+ bias float32): every product exact, the sums float32."""
    lib = load()
    k = x.shape[1]
    if packed.dtype != torch.bfloat16 or not packed.is_contiguous() or packed.dim() != 3 or tuple(packed.shape) != (
            (n + PAIR_PANEL - 1) // PAIR_PANEL, (k + 1) // 2, 2 * PAIR_PANEL):
        raise ValueError("linear_bf16: packed must be the weight packed by pack_bf16_pairs for this x and n")
    if lib is None:
        return linear_bf16_ref(x, packed, n, bias)
    x = x.contiguous().float()
    m = x.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    b = None if bias is None else bias.float().contiguous()
    if lib.tk_linear_bf16(x.data_ptr(), m, k, packed.data_ptr(), n, _ptr(b), y.data_ptr(), _threads()):
        raise MemoryError("linear_bf16: scratch allocation failed")
    return y


def linear_bf16_ref(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    w = unpack_bf16_pairs(packed, n, x.shape[1]).float()
    return F.linear(round_bf16(x).float(), w, None if bias is None else bias.float())


def round_bf16_kernel(x: torch.Tensor) -> torch.Tensor:
    """The C kernels' activation rounding (for the tests): x [M, K] float32 -> bfloat16 [M, K]."""
    x = x.contiguous().float()
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    load().tk_round_bf16(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


# ---- paged attention -----------------------------------------------------------------------------------------


KV_KINDS = SCALE_KINDS  # the C attention's cache element kinds: the int4 scales' (cpu_kernels.c reads both alike)
KV_NARROW_MAX_D = 512  # head sizes a float16 / bfloat16 cache takes (cpu_kernels.c's KV_NARROW_MAX_D)


def kv_kind(k_cache: torch.Tensor) -> int | None:
    """The C attention's kind for this cache's dtype (float32, float16 or bfloat16, each element widened to float32
    as it is read, so the sums are the float32 path's over the stored values), or None where this build does
    not read it (float16 needs F16C) or the kernels are not loaded."""
    kind = KV_KINDS.get(k_cache.dtype)
    lib = load()
    if kind is None or lib is None or not (lib.tk_kv_kinds() >> kind) & 1:
        return None
    return kind


def attention_fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """float32 queries over a float32, float16 or bfloat16 cache [pages, block, Hkv, D] whose tokens and heads
    are dense."""
    kind = kv_kind(k_cache)
    return (q.dtype == torch.float32 and kind is not None and q.device.type == "cpu"
            and (kind == 0 or k_cache.shape[3] <= KV_NARROW_MAX_D)
            and k_cache.stride(3) == 1 and k_cache.stride(2) == k_cache.shape[3]
            and k_cache.stride(1) == k_cache.shape[2] * k_cache.shape[3])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seqs: torch.Tensor, max_context_len: int, scale: float | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] float32; k_cache/v_cache [num_pages, block, Hkv, D] views with the same strides and dtype
    (float32, float16 or bfloat16; K/V of this step already written); block_tables [S, max_blocks] int64 contiguous; seqs [4, S'] int64: per
    attended sequence its first query row, query count, context length and block-table row. A sequence's
    queries are the last q_len of its context positions and attend causally. Writes those rows of `out`
    (a new [T, Hq, D] tensor when None) and returns it. Call only when `available()` and `attention_fits`."""
    lib = load()
    q = q.contiguous()
    t, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    if v_cache.stride() != k_cache.stride() or v_cache.dtype != k_cache.dtype:
        raise ValueError("k_cache and v_cache must share strides and dtype")
    if out is None:
        out = torch.empty_like(q)
    n = seqs.shape[1]
    p = seqs.data_ptr()
    rc = lib.tk_paged_attention_f32(
        q.data_ptr(), hq, d, k_cache.data_ptr(), v_cache.data_ptr(), hkv, bs, k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.data_ptr(), block_tables.shape[1], p, p + 8 * n, p + 16 * n, p + 24 * n, n,
        max_context_len, d ** -0.5 if scale is None else scale, out.data_ptr(), _threads(), KV_KINDS[k_cache.dtype])
    if rc == 2:
        raise ValueError(f"paged attention: a {k_cache.dtype} cache takes head sizes up to {KV_NARROW_MAX_D}")
    if rc:
        raise MemoryError("paged attention: scratch allocation failed")
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
             offsets: torch.Tensor) -> None:
    """k, v [T, Hkv, D] float32 into k_cache/v_cache [num_pages, block, Hkv, D] at (pages[t], offsets[t]) (int64);
    the same as `k_cache[pages, offsets] = k.to(k_cache.dtype)` (a float16 / bfloat16 cache: each value rounded to
    nearest even, as torch rounds). Call only when `available()` and `attention_fits`."""
    k, v = k.float().contiguous(), v.float().contiguous()
    load().tk_write_kv_f32(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k.shape[0],
                           k.shape[1] * k.shape[2], k_cache.stride(0), k_cache.stride(1), pages.data_ptr(),
                           offsets.data_ptr(), KV_KINDS[k_cache.dtype])


def rope_(x: torch.Tensor, heads: tuple[int, int], head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """RoPE in place on heads [h0, h1) of x [T, *] float32 (last dim dense, head h at h * head_dim; e.g. the
    q and k columns of a fused q/k/v projection), cos/sin [T, head_dim] contiguous: bit-identical to
    `engines.model.apply_rope`. Call only when `available()`."""
    if x.stride(1) != 1 or cos.stride() != (head_dim, 1) or sin.stride() != (head_dim, 1):
        raise ValueError("rope_ needs a dense last dimension and contiguous cos/sin")
    load().tk_rope_f32(x.data_ptr(), x.shape[0], x.stride(0), heads[0], heads[1], head_dim, cos.data_ptr(),
                       sin.data_ptr())
