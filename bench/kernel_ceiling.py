"""How fast each one-row linear can go at all on this CPU: a decode pass's linears at one activation row (a
one-sequence decode step) with the weights in cache against the same pass from memory and a plain read of the
same bytes, in one process, alternated rep by rep.

- memory: every linear of a model's layers (`--shape hidden,intermediate,layers`) (fused q/k/v [h + h/2], o [h], gate/up [2 i],
  down [i -> h]), distinct weights per layer carved end to end from huge pages (`hugepages.arena()`, as the C
  decoder's build places a model's): what decode reads;
- cache: one layer's four weights (their rows cut in proportion where the layer is over 12 MiB), called `--inner`
  times a pass, so they come from this CPU's caches (L3: 32 MiB; L2: 1 MiB a core) with each call's own work as
  in decode: the kernel's arithmetic with next to no memory traffic, its ceiling on this core;
- stream: a huge-page torch.sum over the memory set's bytes, thread-count matched.

If a kernel's in-cache rate is near the stream's, one-stream decode in that format cannot come near the stream
from memory whatever the memory side does (both must overlap perfectly to reach even that); what would change it
is cheaper arithmetic per weight byte. int4 at the engine's group (64) by default, `--group 128` for the other.
Writes bench/results/kernel_ceiling.json (or `--out`).

    .venv/bin/python bench/kernel_ceiling.py [--quant f32,bf16,w8a8,int4] [--shape 1024,3072,16 2048,5632,6]
        [--threads 1 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.kernel_ab import QUANTS, layer_calls  # noqa: E402
from bench.results_meta import write_results  # noqa: E402
from kernels import cpu_kernels as ck  # noqa: E402
from kernels import hugepages  # noqa: E402

CACHE_BYTES = 12 << 20  # the in-cache set (a layer where it fits; this CPU's L3: 32 MiB, L2: 1 MiB a core)


def shapes(h: int, inter: int) -> list[tuple[int, int]]:
    """(K, N) of one layer's linears, as the C decoder's build fuses them."""
    return [(h, h + h // 2), (h, h), (h, 2 * inter), (inter, h)]


def cache_rows(k: int, n: int, layer_bytes: int) -> int:
    """Rows of the in-cache copy of a [n, k] weight: all where the layer fits CACHE_BYTES, else cut in proportion
    (a multiple of 16, at least 128)."""
    rows = n * CACHE_BYTES // layer_bytes
    return min(n, max(128, rows // 16 * 16))


def measure(lib, quant: str, h: int, inter: int, layers: int, threads: int, group: int, reps: int,
            inner: int) -> dict:
    g = torch.Generator().manual_seed(h * 7 + inter)
    with hugepages.arena():  # carved end to end from huge pages, as the C decoder's build places a model
        mem = [layer_calls(quant, k, n, threads, g, 1, group) for _ in range(layers) for k, n in shapes(h, inter)]
    layer_bytes = sum(c[1] for c in mem[:len(shapes(h, inter))])  # one layer's weights, as stored
    hot = [layer_calls(quant, k, cache_rows(k, n, layer_bytes), threads, g, 1, group) for k, n in shapes(h, inter)]
    mem_bytes, hot_bytes = sum(c[1] for c in mem), inner * sum(c[1] for c in hot)
    buf = hugepages.empty((mem_bytes // 4,), torch.float32)
    buf.fill_(1.0)

    def run(calls, times=1):
        for _ in range(times):
            for call, _, y, _ in calls:
                if call(lib, y):
                    raise RuntimeError(f"the {quant} kernel refused its arguments")

    run(mem)
    run(hot, inner)
    float(buf.sum())
    t_mem, t_hot, t_sum = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        run(mem)
        t1 = time.perf_counter()
        run(hot, inner)
        t2 = time.perf_counter()
        buf.sum()
        t3 = time.perf_counter()
        t_mem.append(t1 - t0)
        t_hot.append(t2 - t1)
        t_sum.append(t3 - t2)
    mem_gb = [mem_bytes / t / 1e9 for t in t_mem]
    hot_gb = [hot_bytes / t / 1e9 for t in t_hot]
    sum_gb = [mem_bytes / t / 1e9 for t in t_sum]
    return {"quant": quant, "shape": f"{h},{inter},{layers}", "threads": threads, "group": group if quant == "int4" else None,
            "memory_mb": round(mem_bytes / 1e6, 1), "cache_set_kb": round(hot_bytes / inner / 1024),
            "memory_gb_s": round(statistics.median(mem_gb), 1), "cache_gb_s": round(statistics.median(hot_gb), 1),
            "stream_gb_s": round(statistics.median(sum_gb), 1),
            # per rep, each against the same rep's read: the minute's bandwidth cancels
            "memory_of_stream": round(statistics.median(m / s for m, s in zip(mem_gb, sum_gb)), 2),
            "cache_of_stream": round(statistics.median(c / s for c, s in zip(hot_gb, sum_gb)), 2),
            "cache_of_stream_p10_p90": [round(v, 2) for v in
                                        statistics.quantiles([c / s for c, s in zip(hot_gb, sum_gb)], n=10)[::8]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", default="f32,bf16,w8a8,int4", help="comma list of " + ", ".join(QUANTS))
    ap.add_argument("--shape", nargs="+", default=["1024,3072,16", "2048,5632,6"],
                    help="hidden,intermediate,layers (the ~200M and ~1B random Llamas' shapes by default)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--group", type=int, default=64, choices=(64, 128), help="int4 group size")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--inner", type=int, default=8, help="passes over the in-cache set per rep")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kernel_ceiling.json"))
    args = ap.parse_args(argv)
    lib = ck.load()
    if lib is None:
        print(f"no CPU kernels here ({ck.build_error}): nothing to measure")
        return 0
    cells = []
    print("| shape | weights | threads | from memory GB/s | in cache GB/s | stream GB/s | memory / stream | "
          "cache / stream |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shape:
        h, inter, layers = (int(v) for v in shape.split(","))
        for quant in args.quant.split(","):
            for threads in args.threads:
                torch.set_num_threads(threads)
                c = measure(lib, quant, h, inter, layers, threads, args.group, args.reps, args.inner)
                cells.append(c)
                print(f"| {shape} | {quant} | {threads} | {c['memory_gb_s']} | {c['cache_gb_s']} | "
                      f"{c['stream_gb_s']} | {c['memory_of_stream']} | {c['cache_of_stream']} "
                      f"({c['cache_of_stream_p10_p90'][0]}-{c['cache_of_stream_p10_p90'][1]}) |", flush=True)
    write_results(args.out, {"benchmark": "kernel_ceiling", "shapes": args.shape, "group": args.group,
                             "reps": args.reps, "inner": args.inner, "simd": ck.simd_level(), "cells": cells})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
