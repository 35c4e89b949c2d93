"""w8a8 at many rows: the weight-stationary VNNI tiles (`tk_w8_many_rows`, from 8 rows) against the row-pair
tiles they replace there, beside the bf16 and float32 linears (the register tiles and the MKL SGEMM torch
ships) on the same shapes, one thread, GOP/s of one pass
over a ~200M Llama layer's projections (weights from memory: 8 layers' worth cycled). Prints a table and writes
bench/results/cpu_w8a8_rows.json.

    .venv/bin/python bench/cpu_w8a8_rows.py [--rows 1 8 16 32 64] [--layers 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402
from kernels import cpu_kernels as ck  # noqa: E402
from kernels.quant_formats import quantize_int8  # noqa: E402

SHAPES = [(1536, 1024), (1024, 1024), (6144, 1024), (1024, 3072)]  # (N, K): qkv, o, gate_up, down of ~200M


def _passes(lib, many: int, q8: list, bf: list, f32: list, ws: list, xs: dict) -> dict:
    """One pass over every weight by each path, at the rows of `xs` (activations by K)."""

    def w8(on: bool) -> None:
        lib.tk_w8_many_rows(many if on else ck.NEVER)
        for (q, s), w in zip(q8, ws):
            ck.linear_w8a8(xs[w.shape[1]], q, s)

    return {"w8a8 weight-stationary": lambda: w8(True), "w8a8 row pairs": lambda: w8(False),
            "bf16 (bf16 activations)": lambda: [ck.linear_bf16(xs[w.shape[1]], p, w.shape[0]) for p, w in zip(bf, ws)],
            "float32 panels": lambda: _f32(ck.NEVER, f32, ws, xs),
            "float32 MKL SGEMM": lambda: _f32(1, f32, ws, xs)}


def _f32(sgemm_from: int, f32: list, ws: list, xs: dict) -> None:
    """The float32 linears over panels: the register tiles (`sgemm_from` NEVER), or the MKL SGEMM from that row."""
    before = ck.sgemm_min_rows()
    ck.sgemm_min_rows(sgemm_from)
    try:
        for p, w in zip(f32, ws):
            ck.linear_packed(xs[w.shape[1]], p, w.shape[0])
    finally:
        ck.sgemm_min_rows(before)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_w8a8_rows.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    lib = ck.load()
    if lib is None:
        raise SystemExit(f"CPU kernels unavailable: {ck.build_error}")
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) for _ in range(args.layers) for n, k in SHAPES]
    q8 = [quantize_int8(w) for w in ws]
    bf = [ck.pack_bf16_pairs(w) for w in ws]
    f32 = [ck.pack_f32(w) for w in ws]
    many = lib.tk_w8_many_rows(-1)
    rows_out = []
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g) for _, k in SHAPES}

        passes = _passes(lib, many, q8, bf, f32, ws, xs)
        best = dict.fromkeys(passes, float("inf"))
        for rnd in range(args.reps + 1):
            for name, fn in passes.items():
                t = time.perf_counter()
                fn()
                if rnd:
                    best[name] = min(best[name], time.perf_counter() - t)
        flops = sum(2 * m * w.numel() for w in ws)
        row = {"rows": m, **{name: round(flops / sec / 1e9, 1) for name, sec in best.items()}}
        rows_out.append(row)
        print("  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    lib.tk_w8_many_rows(many)
    write_results(Path(args.out), {"bench": "cpu_w8a8_rows", "unit": "GOP/s, one thread", "shapes": SHAPES,
                                   "layers": args.layers, "simd": ck.simd_level(), "rows": rows_out}, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
