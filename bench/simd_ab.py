"""The CPU kernels' AVX-512 build against their AVX2 build (`-mno-avx512f`), both loaded in one process and timed
alternately (thread time, best of `--reps` rounds of 20 calls) on tandem-tiny-l's and the ~80M Llama's layer
shapes at 1, 5 and 8 rows: float32 linears (16-wide streams, 5-8 rows summed in registers; checked bit for bit)
and w8a8 (two blocks per vector with vpdpbusd under VNNI, AMX tiles off; the largest difference reported). Prints a table, writes bench/results/simd_ab.json; on a CPU
without AVX-512 it says so and exits.

    .venv/bin/python bench/simd_ab.py [--rows 1 5 8] [--reps 15]
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
from kernels import cpu_kernels as ck  # noqa: E402
from kernels.quant_matmul import quantize_int8  # noqa: E402

SHAPES = [("tiny-l qkv", 512, 256), ("tiny-l o", 256, 256), ("tiny-l gate+up", 1408, 256),
          ("tiny-l down", 256, 704), ("tiny-l head", 4096, 256), ("80M gate+up", 4096, 768), ("80M down", 768, 2048)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 8])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "simd_ab.json"))
    args = ap.parse_args(argv)
    if not ck.simd_level().startswith("avx512"):
        print(f"this CPU runs the {ck.simd_level()} paths only: nothing to compare")
        return 0
    torch.set_num_threads(1)
    libs = {"avx2": ck.build_variant("avx2"), "avx512": ck.build_variant("native")}
    libs["avx512"].tk_set_amx(0)  # the vector tiles at every row count (bench/amx_ab.py compares the AMX ones)
    rows = []
    for label, n, k in SHAPES:
        for m in args.rows:
            g = torch.Generator().manual_seed(m * n + k)
            x, wt = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
            q, s = quantize_int8(torch.randn(n, k, generator=g))
            row = {"shape": label, "n": n, "k": k, "rows": m}
            for kind in ("f32", "w8a8"):
                best, outs = {}, {}
                for _ in range(args.reps):
                    for name, lib in libs.items():
                        y = torch.empty(m, n)
                        t = time.thread_time_ns()
                        for _ in range(20):
                            if kind == "f32":
                                lib.tk_linear_f32(x.data_ptr(), m, k, wt.data_ptr(), n, n, None, y.data_ptr(), 1)
                            else:
                                lib.tk_linear_w8a8(x.data_ptr(), m, k, q.data_ptr(), s.data_ptr(), n, None,
                                                   y.data_ptr(), 1)
                        us = (time.thread_time_ns() - t) / 20 / 1e3
                        best[name] = min(best.get(name, us), us)
                        outs[name] = y
                row[f"{kind}_avx2_us"] = round(best["avx2"], 1)
                row[f"{kind}_avx512_us"] = round(best["avx512"], 1)
                row[f"{kind}_speedup"] = round(best["avx2"] / best["avx512"], 2)
                row[f"{kind}_same_bits"] = bool(torch.equal(outs["avx2"], outs["avx512"]))
                row[f"{kind}_max_rel_diff"] = float((outs["avx2"] - outs["avx512"]).abs().max()
                                                    / outs["avx2"].abs().max())
            rows.append(row)
    print(f"simd: {ck.simd_level()}\n")
    print("| shape | N x K | rows | f32 AVX2 us | f32 AVX-512 us | speedup | w8a8 AVX2 us | w8a8 AVX-512 (VNNI) us "
          "| speedup | f32 same bits | w8a8 max diff / max |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['n']} x {r['k']} | {r['rows']} | {r['f32_avx2_us']} | {r['f32_avx512_us']} | "
              f"{r['f32_speedup']:.2f}x | {r['w8a8_avx2_us']} | {r['w8a8_avx512_us']} | {r['w8a8_speedup']:.2f}x | "
              f"{r['f32_same_bits']} | {r['w8a8_max_rel_diff']:.1e} |")
    write_results(Path(args.out), {"simd": ck.simd_level(), "reps": args.reps, "rows": rows}, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
