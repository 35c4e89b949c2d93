"""The C decode attention over float32 KV pages (`tk_paged_attention_f32`, what the C decoder stack runs each
layer): one query per sequence, S sequences of `ctx` keys, every layer of a model's shape (its own pages, from one
huge-page pool laid out as engines/kv_pool.py lays it: [page][K/V][layer][slot][KV head][dim]), timed per decode
step (all layers) for two builds of kernels/cpu_kernels.c: `--base`'s source against the working tree's, both
loaded in one process and timed alternately, and whether they give the same bits. Reports ms per step, the K/V
bytes a step reads per second, and the ratio tree / base (the median of per-pair ratios). Writes
bench/results/attention_cpu.json (or `--out`).

    .venv/bin/python bench/attention_cpu.py --base HEAD~1 [--cells 1x100 1x300 8x300 32x300 1x2000]
        [--threads 1 2] [--shape 16,16,4,64] [--simd avx2]
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

from bench.kernel_ab import ab_builds  # noqa: E402
from bench.results_meta import write_results  # noqa: E402
from kernels import cpu_kernels as ck  # noqa: E402
from kernels import hugepages  # noqa: E402


def step_call(S: int, ctx: int, layers: int, hq: int, hkv: int, d: int, threads: int, bs: int = 16):
    """(call(lib, out), K/V bytes a step reads, keep-alive) for one decode step's attention over every layer."""
    g = torch.Generator().manual_seed(S * 7919 + ctx)
    pages = -(-ctx // bs)
    shape = (S * pages + 1, 2, layers, bs, hkv, d)
    pool = hugepages.empty(shape, torch.float32)
    pool.copy_(torch.randn(shape, generator=g))
    order = torch.randperm(S * pages, generator=g)  # a served pool's pages are not in order
    bt = order.view(S, pages).contiguous()
    q = torch.randn(S, hq, d, generator=g)
    seqs = torch.tensor([list(range(S)), [1] * S, [ctx] * S, list(range(S))], dtype=torch.int64)
    p = seqs.data_ptr()
    caches = [(pool[:, 0, li], pool[:, 1, li]) for li in range(layers)]
    kc0 = caches[0][0]
    strides = (kc0.stride(0), kc0.stride(1), kc0.stride(2))

    def call(lib, out):
        for kc, vc in caches:
            rc = lib.tk_paged_attention_f32(q.data_ptr(), hq, d, kc.data_ptr(), vc.data_ptr(), hkv, bs, *strides,
                                            bt.data_ptr(), pages, p, p + 8 * S, p + 16 * S, p + 24 * S, S, ctx,
                                            d ** -0.5, out.data_ptr(), threads, 0)
            if rc:
                raise MemoryError("paged attention scratch")

    return call, S * ctx * layers * 2 * hkv * d * 4, (pool, bt, q, seqs, caches)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision whose kernels/cpu_kernels.c is the baseline")
    ap.add_argument("--cells", nargs="+", default=["1x100", "1x300", "8x300", "32x300", "1x2000"],
                    help="SxCTX: S sequences of CTX keys each")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--shape", default="16,16,4,64", help="layers,query heads,KV heads,head dim (~200M's)")
    ap.add_argument("--pairs", type=int, default=15)
    ap.add_argument("--simd", choices=("native", "avx2"), default="native",
                    help="avx2: both builds without AVX-512, as an AVX2-only CPU runs them")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "attention_cpu.json"))
    args = ap.parse_args(argv)
    if ck.load() is None:
        print(f"no CPU kernels here ({ck.build_error}): nothing to compare")
        return 0
    libs, base_rev = ab_builds(args.base, ROOT / "kernels" / "cpu_kernels.c", "tandem_attention_ab", args.simd)
    layers, hq, hkv, d = (int(v) for v in args.shape.split(","))
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for cell in args.cells:
            S, ctx = (int(v) for v in cell.split("x"))
            call, nbytes, keep = step_call(S, ctx, layers, hq, hkv, d, threads)
            outs = {k: torch.zeros(S, hq, d) for k in libs}
            for k, lib in libs.items():
                call(lib, outs[k])  # warm: pages touched, scratch grown
            reps = max(1, int(2e8 // nbytes))
            times: dict[str, list[float]] = {k: [] for k in libs}
            for i in range(args.pairs):
                for k in (("base", "tree") if i % 2 == 0 else ("tree", "base")):
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        call(libs[k], outs[k])
                    times[k].append((time.perf_counter() - t0) / reps)
            ratios = sorted(t / b for t, b in zip(times["tree"], times["base"]))
            row = {"threads": threads, "sequences": S, "ctx": ctx, "kv_bytes": nbytes,
                   "same_bits": bool(torch.equal(outs["base"], outs["tree"])),
                   "ratio": statistics.median(ratios), "ratio_p10": ratios[len(ratios) // 10],
                   "ratio_p90": ratios[-1 - len(ratios) // 10]}
            for k in libs:
                ms = 1e3 * statistics.median(times[k])
                row[k] = {"ms_per_step": ms, "gb_s": nbytes / ms / 1e6}
            rows.append(row)
            print(f"t{threads} {S} x {ctx} keys: base {row['base']['ms_per_step']:.3f} ms ({row['base']['gb_s']:.1f} "
                  f"GB/s), tree {row['tree']['ms_per_step']:.3f} ms ({row['tree']['gb_s']:.1f} GB/s), ratio "
                  f"{row['ratio']:.2f} ({row['ratio_p10']:.2f}-{row['ratio_p90']:.2f}), same bits "
                  f"{row['same_bits']}", flush=True)
            del keep
    write_results(Path(args.out), {"config": vars(args), "base_commit": base_rev, "rows": rows}, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
