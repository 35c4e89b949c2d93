"""Decode GEMV / skinny GEMM on the CPU, per layer shape: torch's float32 `F.linear` (column-major weight, what
the engine stores) against kernels/cpu_kernels.c's `linear`, and torch's `_weight_int8pack_mm` (bf16
activations, QuantLinear's packed path) against the kernels' `linear_int8` (float32 activations), with the
achieved weight-read bandwidth (weight bytes / time). Thread CPU time, best of `--reps` rounds (steadier than
wall time on a shared machine). Prints a table, writes bench/results/gemv_cpu.json.

    .venv/bin/python bench/gemv_cpu.py [--threads 1] [--rows 1 4 8] [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kernels import cpu_kernels as ck  # noqa: E402
from kernels.quant_matmul import quantize_int8  # noqa: E402

# (name, out_features, in_features): tandem-tiny-l's layers and head, and the ~80M Llama of bench/vs_llamacpp.py
SHAPES = [("tiny-l qkv", 512, 256), ("tiny-l o", 256, 256), ("tiny-l gate+up", 1408, 256),
          ("tiny-l down", 256, 704), ("tiny-l head", 4096, 256), ("80M qkv", 1280, 768), ("80M o", 768, 768),
          ("80M gate+up", 4096, 768), ("80M down", 768, 2048), ("80M head", 4096, 768)]


def best_time(fn, reps: int) -> float:
    fn()
    n = 20
    best = float("inf")
    for _ in range(reps):
        t = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - t) / n)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gemv_cpu.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not ck.available():
        raise SystemExit(f"CPU kernels unavailable: {ck.build_error}")
    rows = []
    print("| shape | N x K | rows | f32 torch us (GB/s) | f32 kernel us (GB/s) | int8 packed us (GB/s) | "
          "int8 kernel us (GB/s) |")
    print("|---|---|---|---|---|---|---|")
    for name, n, k in SHAPES:
        g = torch.Generator().manual_seed(n + k)
        w = torch.randn(n, k, generator=g).t().contiguous().t()
        q, s = quantize_int8(w)
        q = q.contiguous()
        s_bf16 = s.to(torch.bfloat16)
        for m in args.rows:
            x = torch.randn(m, k, generator=g)
            xb = x.to(torch.bfloat16)
            t = {"f32_torch": best_time(partial(F.linear, x, w), args.reps),
                 "f32_kernel": best_time(partial(ck.linear, x, w), args.reps),
                 "int8_packed": best_time(partial(torch.ops.aten._weight_int8pack_mm, xb, q, s_bf16), args.reps),
                 "int8_kernel": best_time(partial(ck.linear_int8, x, q, s), args.reps)}
            gbs = {key: (n * k * (4 if key.startswith("f32") else 1)) / v / 1e9 for key, v in t.items()}
            rows.append({"shape": name, "n": n, "k": k, "rows": m, "us": {kk: v * 1e6 for kk, v in t.items()},
                         "gb_s": gbs})
            print(f"| {name} | {n} x {k} | {m} | " + " | ".join(
                f"{t[key] * 1e6:.1f} ({gbs[key]:.1f})" for key in ("f32_torch", "f32_kernel", "int8_packed",
                                                                  "int8_kernel")) + " |", flush=True)
    out = {"rows": rows, "threads": args.threads, "machine": platform.processor(), "cpus": os.cpu_count(),
           "loadavg": os.getloadavg(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
