"""w8a8 on AMX int8 tiles against the AVX-512 VNNI vector tiles, both in one build, timed alternately (thread time,
best of `--reps` rounds of 20 calls, one thread) on tandem-tiny-l's and the ~80M Llama's layer shapes at 4-256
rows (decode batches, verify windows, prefill chunks). Reports us per call, the speedup, the tiles' GMAC/s and
the largest difference (the same integer dots, float sums in another order). Prints a table, writes
bench/results/amx_ab.json; on a CPU (or kernel) without AMX int8 it says so and exits.

    .venv/bin/python bench/amx_ab.py [--rows 4 8 16 32 64 256] [--reps 15]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402
from bench.simd_ab import SHAPES  # noqa: E402
from kernels import cpu_kernels as ck  # noqa: E402
from kernels.quant_matmul import quantize_int8  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16, 32, 64, 256])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "amx_ab.json"))
    args = ap.parse_args(argv)
    lib = ck.load()
    if lib is None or not ck.set_amx(True, lib):
        print(f"no AMX int8 here (SIMD level {ck.simd_level()}, or Linux refused the tile state): nothing to compare")
        return 0
    torch.set_num_threads(1)
    rows = []
    try:
        for label, n, k in SHAPES:
            for m in args.rows:
                g = torch.Generator().manual_seed(m * n + k)
                x = torch.randn(m, k, generator=g)
                q, s = quantize_int8(torch.randn(n, k, generator=g))
                best, outs = {}, {}
                for _ in range(args.reps):
                    for name in ("vnni", "amx"):
                        ck.set_amx(name == "amx", lib)
                        y = torch.empty(m, n)
                        t = time.thread_time_ns()
                        for _ in range(20):
                            lib.tk_linear_w8a8(x.data_ptr(), m, k, q.data_ptr(), s.data_ptr(), n, None, y.data_ptr(), 1)
                        us = (time.thread_time_ns() - t) / 20 / 1e3
                        best[name] = min(best.get(name, us), us)
                        outs[name] = y
                rows.append({"shape": label, "n": n, "k": k, "rows": m, "vnni_us": round(best["vnni"], 1),
                             "amx_us": round(best["amx"], 1), "speedup": round(best["vnni"] / best["amx"], 2),
                             "amx_gmac_s": round(m * n * k / best["amx"] / 1e3, 1),
                             "max_rel_diff": float((outs["vnni"] - outs["amx"]).abs().max() / outs["vnni"].abs().max())})
    finally:
        ck.set_amx(True, lib)
    print("| shape | N x K | rows | VNNI us | AMX us | speedup | AMX GMAC/s | max diff / max |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['n']} x {r['k']} | {r['rows']} | {r['vnni_us']} | {r['amx_us']} | "
              f"{r['speedup']:.2f}x | {r['amx_gmac_s']} | {r['max_rel_diff']:.1e} |")
    write_results(Path(args.out), {"simd": ck.simd_level(), "reps": args.reps, "rows": rows}, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
