"""Decode GEMV / skinny GEMM on the CPU, per layer shape: torch's float32 `F.linear` (column-major weight, what
the engine stores) against kernels/cpu_kernels.c's `linear`, torch's `_weight_int8pack_mm` (bf16 activations,
QuantLinear's packed path before the C kernels) against the kernels' `linear_int8` (float32 activations),
`linear_w8a8` (int8 activations, integer dots) and `linear_w4a8` (int4 in groups of 64), with the achieved
weight-read bandwidth (weight bytes / time). Each shape alone sits in the caches; `--model-pass` also times
whole models' layers (tandem-tiny-l and the ~80M Llama) cycled through copies that exceed the caches, so the
weights stream from memory as in a decode step, next to a plain read of the same float32 bytes (`torch.sum`:
the machine's streaming rate). Thread CPU time, best of `--reps`
rounds (steadier than wall time on a shared machine). Prints tables, writes bench/results/gemv_cpu.json.

    .venv/bin/python bench/gemv_cpu.py [--threads 1] [--rows 1 4 8] [--reps 7] [--model-pass]
"""

from __future__ import annotations

import argparse
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

from bench.results_meta import write_results  # noqa: E402
from kernels import cpu_kernels as ck  # noqa: E402
from kernels.quant_matmul import pack_zero, quantize_int4, quantize_int8  # noqa: E402

KINDS = ("f32_torch", "f32_kernel", "int8_packed", "int8_kernel", "w8a8_kernel", "int4_kernel")
BYTES = {"f32_torch": 4.0, "f32_kernel": 4.0, "int8_packed": 1.0, "int8_kernel": 1.0, "w8a8_kernel": 1.0,
         "int4_kernel": 0.5 + 6 / 64}  # int4: the nibbles plus a float32 scale and a zero byte per 64

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
    ap.add_argument("--model-pass", action="store_true", help="also whole models' layers from memory")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gemv_cpu.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not ck.available():
        raise SystemExit(f"CPU kernels unavailable: {ck.build_error}")
    rows = []
    print("| shape | N x K | rows | f32 torch us (GB/s) | f32 kernel us (GB/s) | int8 packed us (GB/s) | "
          "int8 kernel us (GB/s) | w8a8 kernel us (GB/s) | int4 g64 kernel us (GB/s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, n, k in SHAPES:
        g = torch.Generator().manual_seed(n + k)
        w = torch.randn(n, k, generator=g).t().contiguous().t()
        q, s = quantize_int8(w)
        q = q.contiguous()
        s_bf16 = s.to(torch.bfloat16)
        p4, s4, z4 = quantize_int4(w, 64)
        z4 = pack_zero(z4)
        p4, s4, z4 = p4.contiguous(), s4.float().contiguous(), z4.contiguous()  # as QuantLinear's buffers
        for m in args.rows:
            x = torch.randn(m, k, generator=g)
            xb = x.to(torch.bfloat16)
            t = {"f32_torch": best_time(partial(F.linear, x, w), args.reps),
                 "f32_kernel": best_time(partial(ck.linear, x, w), args.reps),
                 "int8_packed": best_time(partial(torch.ops.aten._weight_int8pack_mm, xb, q, s_bf16), args.reps),
                 "int8_kernel": best_time(partial(ck.linear_int8, x, q, s), args.reps),
                 "w8a8_kernel": best_time(partial(ck.linear_w8a8, x, q, s), args.reps),
                 "int4_kernel": best_time(partial(ck.linear_w4a8, x, p4, s4, z4, 64), args.reps)}
            gbs = {key: n * k * BYTES[key] / v / 1e9 for key, v in t.items()}
            rows.append({"shape": name, "n": n, "k": k, "rows": m, "us": {kk: v * 1e6 for kk, v in t.items()},
                         "gb_s": gbs})
            print(f"| {name} | {n} x {k} | {m} | " + " | ".join(
                f"{t[key] * 1e6:.1f} ({gbs[key]:.1f})" for key in KINDS) + " |", flush=True)
    passes = model_passes(args.rows, args.reps) if args.model_pass else []
    out = {"rows": rows, "model_passes": passes, "threads": args.threads, "machine": platform.processor(),
           "simd": ck.simd_level(),
           "cpus": os.cpu_count(),
           "loadavg": os.getloadavg(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_results(Path(args.out), out, indent=1)
    return 0


def model_passes(row_counts: list[int], reps: int) -> list[dict]:
    """Each model's linears (no head) in order, over enough copies (>= 192 MB of f32) that every pass reads
    its weights from memory; ms per pass and weight GB/s per kind, and the plain read of the f32 copies."""
    models = {"tiny-l": [s for s in SHAPES if s[0].startswith("tiny-l") and s[0] != "tiny-l head"] * 6,
              "80M": [s for s in SHAPES if s[0].startswith("80M") and s[0] != "80M head"] * 12}
    out = []
    print("\n| model (layers, from memory) | rows | " + " | ".join(f"{k} ms (GB/s)" for k in KINDS[1:])
          + " | plain read GB/s |")
    print("|---|---|" + "---|" * (len(KINDS) - 1) + "---|")
    for model, shapes in models.items():
        params = sum(n * k for _, n, k in shapes)
        copies = max(2, -(-(192 << 20) // (4 * params)))
        g = torch.Generator().manual_seed(1)
        sets = []
        for _ in range(copies):
            layer = []
            for _, n, k in shapes:
                w = torch.randn(n, k, generator=g)
                q, s = quantize_int8(w)
                p4, s4, z4 = quantize_int4(w, 64)
                z4 = pack_zero(z4)
                layer.append((w.t().contiguous().t(), q.contiguous(), s, p4.contiguous(), s4.float().contiguous(),
                              z4.contiguous()))
            sets.append(layer)
        words = [torch.cat([lay[0].t().reshape(-1) for lay in layer]) for layer in sets]
        read = min(_wall(_read, words) for _ in range(reps)) / copies
        for m in row_counts:
            xs = {k: torch.randn(m, k, generator=g) for _, _, k in shapes}
            fns = {"f32_kernel": lambda w, q, s, p4, s4, z4, x: ck.linear(x, w),
                   "int8_packed": lambda w, q, s, p4, s4, z4, x: torch.ops.aten._weight_int8pack_mm(
                       x.to(torch.bfloat16), q, s.to(torch.bfloat16)),
                   "int8_kernel": lambda w, q, s, p4, s4, z4, x: ck.linear_int8(x, q, s),
                   "w8a8_kernel": lambda w, q, s, p4, s4, z4, x: ck.linear_w8a8(x, q, s),
                   "int4_kernel": lambda w, q, s, p4, s4, z4, x: ck.linear_w4a8(x, p4, s4, z4, 64)}
            res = {}
            for kind, fn in fns.items():
                sec = min(_wall(_pass, fn, sets, xs) for _ in range(reps)) / copies
                res[kind] = {"ms": sec * 1e3, "gb_s": params * BYTES[kind] / sec / 1e9}
            out.append({"model": model, "rows": m, "params": params, "copies": copies, "kinds": res,
                        "plain_read_gb_s": 4 * params / read / 1e9})
            print(f"| {model} | {m} | " + " | ".join(f"{res[k]['ms']:.2f} ({res[k]['gb_s']:.1f})" for k in KINDS[1:])
                  + f" | {4 * params / read / 1e9:.1f} |", flush=True)
    return out


def _read(words: list[torch.Tensor]) -> None:
    for wd in words:
        torch.sum(wd)


def _pass(fn, sets: list, xs: dict) -> None:
    for layer in sets:
        for lay in layer:
            fn(*lay, xs[lay[0].shape[1]])


def _wall(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


if __name__ == "__main__":
    raise SystemExit(main())
