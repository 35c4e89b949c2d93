"""Two builds of kernels/cpu_kernels.c over one activation row (a one-sequence decode step; `--rows M`: M rows):
source (`--base`) against the working tree's (or `--source`'s), both loaded in one process and timed alternately,
a pass at a time, where a pass is every linear of a model's layers (`--shape hidden,intermediate,layers`: fused q/k/v
[h + h/2], o [h], gate/up [2 i], down [i -> h]) with distinct weights per layer, so they come from memory as in
decode. Reports each build's ms per pass and GB/s of weights, their time ratio (tree / base: the median of the
per-pair ratios and its p10-p90), each build's share of the streaming rate (a huge-page torch.sum over the same
bytes, right after each pair), and whether the two builds give the same bits. Each weight is its own huge-page
mapping (`hugepages.copy`), or with `--arena` all are carved end to end from one `hugepages.arena()`. Writes
bench/results/kernel_ab_<quant>.json (or `--out`). On a VM whose bandwidth swings minute to minute, `--runs N` measures
each cell N times on weights placed anew and reports the runs' medians.

    .venv/bin/python bench/kernel_ab.py --base HEAD~1 --quant int4 --shape 1024,3072,16 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
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
from kernels.quant_formats import pack_zero, quantize_int4, quantize_int8  # noqa: E402

QUANTS = ("int4", "w8a8", "bf16", "f32")


def layer_calls(quant: str, k: int, n: int, threads: int, g: torch.Generator, rows: int = 1, group: int = 128):
    """(call(lib, y), nbytes, y, keep-alive) for one [n, k] weight at `rows` activation rows (int4: `group`)."""
    x, y, w = torch.randn(rows, k, generator=g), torch.empty(rows, n), torch.randn(n, k, generator=g) * 0.02
    if quant == "int4":
        packed, scale, zero = quantize_int4(w, group)  # float16 scales and zero points, as quantize_model keeps them
        zp = pack_zero(zero)  # None where every zero point is 8
        packed, scale, zp = hugepages.copy(packed), hugepages.copy(scale), None if zp is None else hugepages.copy(zp)
        keep = (x, packed, scale, zp)
        nbytes = packed.numel() + 2 * scale.numel() + (0 if zp is None else zp.numel())

        def call(lib, out):
            return lib.tk_linear_w4a8(x.data_ptr(), rows, k, packed.data_ptr(), scale.data_ptr(), 1,
                                      None if zp is None else zp.data_ptr(), 0, group, n, None, out.data_ptr(), threads)
    elif quant == "w8a8":
        q, s = quantize_int8(w)
        q, s = hugepages.copy(q), hugepages.copy(s.float())
        keep, nbytes = (x, q, s), q.numel() + 4 * n

        def call(lib, out):
            return lib.tk_linear_w8a8(x.data_ptr(), rows, k, q.data_ptr(), s.data_ptr(), n, None, out.data_ptr(), threads)
    elif quant == "bf16":
        p = hugepages.copy(ck.pack_bf16_pairs(w))
        keep, nbytes = (x, p), p.numel() * p.element_size()

        def call(lib, out):
            return lib.tk_linear_bf16(x.data_ptr(), rows, k, p.data_ptr(), n, None, out.data_ptr(), threads)
    else:
        p = hugepages.copy(ck.pack_f32(w))
        keep, nbytes = (x, p), p.numel() * 4

        def call(lib, out):
            return lib.tk_linear_f32_panels(x.data_ptr(), rows, k, p.data_ptr(), None, n, None, out.data_ptr(), threads)
    return call, nbytes, y, keep


def measure(args, libs, placed) -> dict:
    """One alternation of the two builds over freshly placed weights: ratios, ms, GB/s and shares."""
    base = placed(args.arena == "on")
    sets = {"base": base, "tree": placed(True) if args.arena == "tree" else base}
    nbytes = sum(c[1] for c in sets["base"])
    buf = hugepages.empty((nbytes // 4,), torch.float32)
    buf.fill_(1.0)

    def run(name):
        for call, _, y, _ in sets[name]:
            call(libs[name], y)

    outs = {}
    for name in libs:
        run(name)
        outs[name] = [c[2].clone() for c in sets[name]]
    same = all(torch.equal(a, b) for a, b in zip(outs["base"], outs["tree"]))
    times = {"base": [], "tree": []}
    sums = []
    for r in range(args.reps):
        for name in (("base", "tree") if r % 2 == 0 else ("tree", "base")):
            t0 = time.perf_counter()
            run(name)
            times[name].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        buf.sum()
        sums.append(time.perf_counter() - t0)
    ratios = sorted(t / b for t, b in zip(times["tree"], times["base"]))
    q = statistics.quantiles(ratios, n=10)
    out = {"weight_mb": round(nbytes / 1e6, 1), "same_bits": same,
           "ratio_tree_over_base": round(statistics.median(ratios), 3), "ratio_p10": round(q[0], 3),
           "ratio_p90": round(q[-1], 3), "sum_gb_s": round(nbytes / statistics.median(sums) / 1e9, 1)}
    for name in ("base", "tree"):
        med = statistics.median(times[name])
        out[f"{name}_ms"] = round(med * 1e3, 2)
        out[f"{name}_gb_s"] = round(nbytes / med / 1e9, 1)
        out[f"{name}_share"] = round(statistics.median(s / t for s, t in zip(sums, times[name])), 2)
    return out


def ab_builds(base: str, source: Path, stem: str, simd: str = "native") -> tuple[dict, str]:
    """{"base": `base`'s kernels/cpu_kernels.c built, "tree": `source` built} (`simd`: cpu_kernels.build_variant's,
    with OpenMP) and the base's full commit hash."""
    base_src = subprocess.run(["git", "show", f"{base}:kernels/cpu_kernels.c"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
    base_rev = subprocess.run(["git", "rev-parse", base], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout.strip()
    libs = {name: ck.build_variant(simd, src, f"{stem}_{simd}_{name}", openmp=True)
            for name, src in (("base", base_src), ("tree", source.read_text()))}
    return libs, base_rev


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision whose kernels/cpu_kernels.c is the baseline")
    ap.add_argument("--quant", choices=QUANTS, default="int4")
    ap.add_argument("--shape", nargs="+", default=["1024,3072,16", "2048,5632,6"],
                    help="hidden,intermediate,layers (the ~200M and ~1B random Llamas' shapes by default)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--group", type=int, default=128, choices=(64, 128), help="int4 group size (the engine's: 64)")
    ap.add_argument("--rows", type=int, default=1, help="activation rows (1: a one-sequence decode step)")
    ap.add_argument("--runs", type=int, default=1,
                    help="measure each cell this many times on weights placed anew each time; the cell's "
                         "figures are then the runs' medians, each run kept under 'runs'")
    ap.add_argument("--source", default=str(ROOT / "kernels" / "cpu_kernels.c"),
                    help="the C source to compare with the base (the working tree's by default)")
    ap.add_argument("--arena", choices=("off", "on", "tree"), default="off",
                    help="on: carve the weights from one hugepages.arena(), end to end, as the C decoder's build "
                         "does; tree: the base build reads per-tensor mappings and the tree build the same values "
                         "from an arena (an A/B of the placement; with the same source, of nothing else)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if ck.load() is None:
        print(f"no CPU kernels here ({ck.build_error}): nothing to compare")
        return 0
    libs, base_rev = ab_builds(args.base, Path(args.source), "tandem_kernel_ab")
    cells = []
    for shape in args.shape:
        h, inter, layers = (int(v) for v in shape.split(","))
        for threads in args.threads:
            torch.set_num_threads(threads)

            def placed(in_arena: bool, h=h, inter=inter, layers=layers, threads=threads) -> list:
                g = torch.Generator().manual_seed(h * 7 + inter)  # the same values in every set
                with hugepages.arena() if in_arena else contextlib.nullcontext():
                    return [layer_calls(args.quant, k, n, threads, g, args.rows, args.group) for _ in range(layers)
                            for k, n in ((h, h + h // 2), (h, h), (h, 2 * inter), (inter, h))]

            runs = []
            for _ in range(args.runs):  # each run on weights placed anew
                runs.append(measure(args, libs, placed))
            cell = {"shape": shape, "threads": threads, **runs[0]}
            if args.runs > 1:  # every figure the runs' median; each run's own spread stays under "runs"
                cell["runs"] = runs
                for key in ("ratio_tree_over_base", "sum_gb_s", *(f"{b}_{f}" for b in ("base", "tree")
                                                                  for f in ("ms", "gb_s", "share"))):
                    cell[key] = round(statistics.median(r[key] for r in runs), 3)
                cell["same_bits"] = all(r["same_bits"] for r in runs)
                del cell["ratio_p10"], cell["ratio_p90"]
            cells.append(cell)
            spread = (f"runs {', '.join(str(r['ratio_tree_over_base']) for r in runs)}" if args.runs > 1
                      else f"{cell['ratio_p10']}-{cell['ratio_p90']}")
            print(f"{args.quant} {shape} threads {threads}: base {cell['base_ms']} ms ({cell['base_share']} of "
                  f"the streaming rate), tree {cell['tree_ms']} ms ({cell['tree_share']}); tree/base "
                  f"{cell['ratio_tree_over_base']} ({spread}), same bits {cell['same_bits']}")
    out = args.out or str(ROOT / "bench" / "results" / f"kernel_ab_{args.quant}.json")
    write_results(out, {"benchmark": "kernel_ab", "quant": args.quant, "base": base_rev, "source": args.source,
                        "arena": args.arena, "reps": args.reps, "runs": args.runs, "rows": args.rows,
                        "group": args.group if args.quant == "int4" else None,
                        "simd": ck.simd_level(), "cells": cells})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
