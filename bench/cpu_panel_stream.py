"""How fast the few-row panel passes read their weights: the kernels as built (one panel a pass, no prefetch
instructions, up to PANEL_HW_ROWS rows) against the same source built with `-DPANEL_HW_ROWS_F32=0
-DPANEL_HW_ROWS_BF16=0` (two panels a pass with software prefetches 16 rows ahead, as before), alternated in one
process over `--layers` weights of [--n, --k] (805 MB of float32 by default: far past the caches, as a decode
step's), float32 panels and their bf16 copies, 1-5 rows, 1 and 2 threads; and torch.sum's read of as many bytes
(the streaming reference of bench/vs_llamacpp.py). Medians of `--reps` passes in GB/s of weight read. Prints a
table, writes bench/results/cpu_panel_stream.json.

    .venv/bin/python bench/cpu_panel_stream.py [--rows 1 2 3 4 5] [--threads 1 2] [--reps 5]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402
from kernels import cpu_kernels as ck  # noqa: E402
from kernels import hugepages  # noqa: E402
from kernels.cbuild import build_library  # noqa: E402

BEFORE = ["-DPANEL_HW_ROWS_F32=0", "-DPANEL_HW_ROWS_BF16=0"]


def _build(defs: list[str]) -> ctypes.CDLL:
    so = build_library(ck._SRC.read_text(), "tandem_cpu_kernels_panel_stream", [*ck._FLAGS, "-fopenmp", *defs],
                       ck.cache_dir(), key=(ck._cpu_flags(),))
    return ck._bind(ctypes.CDLL(str(so)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_panel_stream.json"))
    args = ap.parse_args(argv)
    if ck.simd_level() not in ("avx512", "avx512-vnni"):
        raise SystemExit(f"the few-row panel passes are the AVX-512 kernels'; this build is {ck.simd_level()}")
    libs = {"before": _build(BEFORE), "now": _build([])}
    k, n = args.k, args.n
    weights = [torch.randn(n, k) for _ in range(args.layers)]
    f32 = [ck.pack_f32(w) for w in weights]
    bf16 = [ck.pack_bf16(w) for w in weights]
    del weights
    reference = hugepages.copy(torch.randn(args.layers * n * k))

    def rate(lib: ctypes.CDLL, kind: str, rows: int, threads: int) -> float:
        x, y = torch.randn(rows, k), torch.empty(rows, n)
        t = time.perf_counter()
        for i, wp in enumerate(f32):
            w16 = bf16[i].data_ptr() if kind == "bf16" else None
            lib.tk_linear_f32_panels(x.data_ptr(), rows, k, wp.data_ptr(), w16, n, None, y.data_ptr(), threads)
        return args.layers * n * k * (2 if kind == "bf16" else 4) / (time.perf_counter() - t) / 1e9

    rows_out = []
    print("| weights | threads | rows | before GB/s | now GB/s | now / before | torch.sum GB/s |")
    print("|---|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for kind in ("f32", "bf16"):
            for rows in args.rows:
                got: dict[str, list[float]] = {"before": [], "now": [], "sum": []}
                for _ in range(args.reps):
                    for name, lib in libs.items():
                        got[name].append(rate(lib, kind, rows, threads))
                    t = time.perf_counter()
                    reference.sum()
                    got["sum"].append(reference.numel() * 4 / (time.perf_counter() - t) / 1e9)
                med = {name: statistics.median(v) for name, v in got.items()}
                row = {"weights": kind, "threads": threads, "rows": rows, "before_gb_s": round(med["before"], 2),
                       "now_gb_s": round(med["now"], 2), "ratio": round(med["now"] / med["before"], 3),
                       "torch_sum_gb_s": round(med["sum"], 2), "samples": got}
                rows_out.append(row)
                print(f"| {kind} | {threads} | {rows} | {row['before_gb_s']} | {row['now_gb_s']} | {row['ratio']}x | "
                      f"{row['torch_sum_gb_s']} |", flush=True)
    write_results(Path(args.out), {"k": k, "n": n, "layers": args.layers, "reps": args.reps,
                                   "weight_mb": round(args.layers * n * k * 4 / 1e6), "rows": rows_out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
