"""The float32 CPU linears over a whole model's layers, weights in memory rather than in cache: one pass over
every projection of the ~80M Llama (12 layers, 320 MB) or tandem-tiny-l (6 layers and the head, 20 MB, which
the caches hold), at 1, 5, 6 and 8 rows, the way a decode step reads them. Three builds of kernels/cpu_kernels.c
in one process, alternated: as shipped (5-8 row register blocks on weights up to 4 MiB, streams above),
streams only (-DBLOCK_MAX_KN=0), blocks on every size (-DBLOCK_MAX_KN=2^40), and that without the blocks'
prefetch of the next 32 columns into L2 (-DBLOCK_NEXT_PF=0: the kernels before this rule). Reports the
best ms per pass and the GB/s it reads, beside one thread's plain read bandwidth over 320 MB (torch.sum).
Prints a table, writes bench/results/cpu_dram.json; needs the AVX-512 build (else says so and exits).

    .venv/bin/python bench/cpu_dram.py [--rows 1 5 6 8] [--reps 7]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402
from kernels import cpu_kernels as ck  # noqa: E402
from kernels.cbuild import build_library  # noqa: E402

MODELS = {  # (K, N) of each projection, in a decode step's order
    "80M": [(768, 1280), (768, 768), (768, 4096), (2048, 768)] * 12,
    "tiny-l": [(256, 512), (256, 256), (256, 1408), (704, 256)] * 6 + [(256, 4096)],
}
BUILDS = {"shipped": [], "streams only": ["-DBLOCK_MAX_KN=0"], "blocks everywhere": ["-DBLOCK_MAX_KN=1099511627776"],
          "before": ["-DBLOCK_MAX_KN=1099511627776", "-DBLOCK_NEXT_PF=0"]}


def read_gb_s(reps: int) -> float:
    x = torch.ones(80 << 20)  # 320 MB
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 6, 8])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_dram.json"))
    args = ap.parse_args(argv)
    if not ck.simd_level().startswith("avx512"):
        print(f"this CPU runs the {ck.simd_level()} paths only: the register blocks are AVX-512's")
        return 0
    torch.set_num_threads(1)
    src = Path(ck._SRC).read_text()
    libs = {name: ck._bind(ctypes.CDLL(str(build_library(src, "tandem_cpu_kernels_dram", [*ck._FLAGS, *flags],
                                                         ck.cache_dir(), key=(ck._cpu_flags(),)))))
            for name, flags in BUILDS.items()}
    bandwidth = read_gb_s(args.reps)
    rows = []
    for model, shapes in MODELS.items():
        weights = [torch.randn(k, n) for k, n in shapes]
        gb = sum(k * n for k, n in shapes) * 4 / 1e9
        for m in args.rows:
            xs = {k: torch.randn(m, k) for k in {k for k, _ in shapes}}
            ys = {n: torch.empty(m, n) for n in {n for _, n in shapes}}
            best: dict[str, float] = {}
            outs: dict[str, torch.Tensor] = {}
            for _ in range(args.reps):
                for name, lib in libs.items():
                    t = time.perf_counter()
                    for (k, n), w in zip(shapes, weights):
                        lib.tk_linear_f32(xs[k].data_ptr(), m, k, w.data_ptr(), n, n, None, ys[n].data_ptr(), 1)
                    best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
                    outs[name] = ys[shapes[-1][1]].clone()
            same = all(torch.equal(outs["shipped"], o) for o in outs.values())
            rows.append({"model": model, "weights_gb": round(gb, 3), "rows": m, "same_bits": same,
                         **{f"{name}_ms": round(s * 1e3, 2) for name, s in best.items()},
                         **{f"{name}_gb_s": round(gb / s, 1) for name, s in best.items()}})
    print(f"one thread's read bandwidth over 320 MB (torch.sum): {bandwidth:.1f} GB/s\n")
    names = list(BUILDS)
    print("| model | weights | rows | " + " | ".join(f"{n} ms (GB/s)" for n in names) + " | same bits |")
    print("|---|---|---|" + "---|" * len(names) + "---|")
    for r in rows:
        cells = " | ".join(f"{r[f'{n}_ms']} ({r[f'{n}_gb_s']})" for n in names)
        print(f"| {r['model']} | {r['weights_gb'] * 1e3:.0f} MB | {r['rows']} | {cells} | {r['same_bits']} |")
    write_results(Path(args.out), {"simd": ck.simd_level(), "read_gb_s": round(bandwidth, 1),
                                          "reps": args.reps, "rows": rows}, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
