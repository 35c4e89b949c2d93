"""The float32 linears' weight layouts from memory: one pass over every projection of a random Llama (the C
forward's fused q/k/v and gate/up, on huge pages as the engine stores them), the column-major `wt [K, N]` the
streams and register blocks read (at each prefetch distance `calibrate` weighs) against the same weights packed
in panels of 32 columns (`cpu_kernels.pack_f32`, read in address order), alternated in one process, at 1 and 2
threads, beside a plain read of as many bytes (torch.sum over huge pages). Best ms per pass of `--reps`, the
GB/s it reads, and whether every output of every way had the same bits; from 3 rows also the [K, N] weight
through its 5-8-row register blocks (what `calibrate` picks over weights from memory on some machines);
`--simd avx2` runs the passes on the build without AVX-512. Then a 32 x 128 linear back to back at one and two
threads (the OpenMP fork/join a split adds). `--decode DIR` also times one greedy stream's
decode on that checkpoint (e.g. bench/vs_llamacpp.py's random llama200m) through the engine, built twice in one
process, with TANDEM_CPU_PANELS=0 ([K, N]) and 1 (panels), alternated: tok/s over `--tokens` (the one-token
generate's time, prefill and first token, taken off), best of `--rounds`. Prints tables, writes
bench/results/cpu_panels.json.

    .venv/bin/python bench/cpu_panels.py [--models llama200m] [--rows 1 2 4 8] [--threads 1 2] [--reps 7]
        [--simd native|avx2] [--decode ~/.cache/tandem/vs_llamacpp/llama200m --tokens 64 --rounds 3]
"""

from __future__ import annotations

import argparse
import ctypes
import os
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

LLAMAS = {"llama80m": (768, 12, 12, 4, 2048), "llama200m": (1024, 16, 16, 4, 3072),
          "llama1b": (2048, 22, 32, 4, 5632)}  # bench/vs_llamacpp.py's: hidden, layers, heads, kv heads, MLP


def shapes(name: str) -> list[tuple[int, int]]:
    """(K, N) of each projection in a decode step's order: q/k/v fused, o, gate/up fused, down."""
    h, layers, heads, kv, mlp = LLAMAS[name]
    d = h // heads
    return [(h, h + 2 * kv * d), (h, h), (h, 2 * mlp), (mlp, h)] * layers


def read_gb_s(nbytes: int, reps: int) -> float:
    x = hugepages.empty((nbytes // 4,), torch.float32)
    x.fill_(1.0)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def decode(folder: str, threads: list[int], tokens: int, rounds: int) -> list[dict]:
    """One greedy stream's decode tok/s on `folder`, [K, N] against panels, per thread count, alternated."""
    from engines import LLM, SamplingParams

    rows = []
    for t in threads:
        llms = {}
        for way, flag in (("[K, N]", "0"), ("panels", "1")):
            os.environ["TANDEM_CPU_PANELS"] = flag
            llms[way] = LLM(folder, max_model_len=512, threads=t)
            assert llms[way].engine.runner.cpu_forward is not None, f"the C forward does not cover {folder}"
        os.environ.pop("TANDEM_CPU_PANELS")
        prompt = ["def fib(n):\n    return"]
        long, one = (SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (tokens, 1))
        best, outs = dict.fromkeys(llms, float("inf")), {}
        for _ in range(rounds + 1):  # the first round warms up
            for way, llm in llms.items():
                t0 = time.perf_counter()
                llm.generate(prompt, one)
                t1 = time.perf_counter()
                out = llm.generate(prompt, long)
                t2 = time.perf_counter()
                outs[way] = out[0].outputs[0].token_ids
                best[way] = min(best[way], (t2 - t1) - (t1 - t0))
        row = {"model": folder, "threads": t, "tokens": tokens, "same_tokens": outs["[K, N]"] == outs["panels"],
               **{f"{w}_tok_s": round((tokens - 1) / s, 1) for w, s in best.items()}}
        row["speedup"] = round(row["panels_tok_s"] / row["[K, N]_tok_s"], 3)
        print(row, flush=True)
        rows.append(row)
        del llms
    return rows


WAYS = {f"[K, N] pf {d}": {"stream_pf": d} for d in ck.STREAM_PF_CHOICES} | {
    "[K, N] blocks": {"block_max_kn": ck.NEVER, "block_max_k": ck.NEVER, "block_min_rows": 3}, "panels": {}}
STREAMS = {"block_max_kn": ck.BLOCK_MAX_KN, "block_max_k": ck.BLOCK_MAX_K, "block_min_rows": ck.BLOCK_MIN_ROWS}


def passes(lib, model: str, rows: list[int], threads: list[int], reps: int) -> tuple[list[dict], dict]:
    """One pass over `model`'s projections per way of WAYS (the [K, N] register blocks from 3 rows only: the
    streams' one-row kernel below that), alternated, best of `reps`; and the plain read per thread count."""
    sh = shapes(model)
    kn = [hugepages.copy(torch.randn(n, k).t()) for k, n in sh]  # wt [K, N] contiguous
    packed = [ck.pack_f32(w.t()) for w in kn]
    nbytes = sum(4 * k * n for k, n in sh)
    out, reads = [], {}
    for t in threads:
        torch.set_num_threads(t)
        reads[f"{model} {t}"] = read_gb_s(nbytes, reps)
        for m in rows:
            xs = {k: torch.randn(m, k) for k, _ in sh}
            ys = [torch.empty(m, n) for _, n in sh]
            ways = {w: knobs for w, knobs in WAYS.items() if m >= 3 or w != "[K, N] blocks"}
            best, outs = dict.fromkeys(ways, float("inf")), {}
            for _ in range(reps):
                for way, knobs in ways.items():
                    for name, v in (STREAMS | knobs).items():
                        getattr(lib, "tk_" + name)(v)
                    t0 = time.perf_counter()
                    for (k, n), w, p, y in zip(sh, kn, packed, ys):
                        if way == "panels":
                            lib.tk_linear_f32_panels(xs[k].data_ptr(), m, k, p.data_ptr(), None, n, None,
                                                     y.data_ptr(), t)
                        else:
                            lib.tk_linear_f32(xs[k].data_ptr(), m, k, w.data_ptr(), n, n, None, y.data_ptr(), t)
                    best[way] = min(best[way], time.perf_counter() - t0)
                    outs[way] = [y.clone() for y in ys]
            same = all(torch.equal(a, b) for o in outs.values() for a, b in zip(outs["panels"], o))
            r = {"model": model, "weights_gb": round(nbytes / 1e9, 3), "threads": t, "rows": m, "same_bits": same,
                 **{f"{w}_ms": round(v * 1e3, 2) for w, v in best.items()},
                 **{f"{w}_gb_s": round(nbytes / v / 1e9, 1) for w, v in best.items()}}
            out.append(r)
            print(f"{model} {t}t {m} rows: " + ", ".join(f"{w} {r[f'{w}_ms']} ms ({r[f'{w}_gb_s']})" for w in ways)
                  + f", same bits {same}", flush=True)
    return out, reads


def fork_join_us(lib, reps: int = 20000) -> dict[str, float]:
    """Microseconds of a 32 x 128 panel linear (about no work) at one and at two threads, back to back: the
    OpenMP fork/join a split linear adds while the workers still spin."""
    p, x, y = ck.pack_f32(torch.randn(128, 32)), torch.randn(1, 32), torch.empty(1, 128)
    best = {}
    for _ in range(3):
        for t in (1, 2):
            t0 = time.perf_counter()
            for _ in range(reps):
                lib.tk_linear_f32_panels(x.data_ptr(), 1, 32, p.data_ptr(), None, 128, None, y.data_ptr(), t)
            best[t] = min(best.get(t, float("inf")), (time.perf_counter() - t0) / reps * 1e6)
    return {f"{t} threads": round(v, 2) for t, v in best.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["llama200m"], choices=list(LLAMAS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--simd", choices=("native", "avx2"), default="native",
                    help="the build the passes run (avx2: without AVX-512, as an AVX2-only CPU would)")
    ap.add_argument("--decode", default=None, help="a checkpoint folder: also time one stream's decode on it")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_panels.json"))
    args = ap.parse_args(argv)
    if ck.load() is None:
        print(f"no CPU kernels: {ck.build_error}")
        return 0
    lib = ck.load() if args.simd == "native" else ck._bind(ctypes.CDLL(str(build_library(
        Path(ck._SRC).read_text(), "tandem_cpu_kernels_avx2_omp", [*ck._FLAGS, "-mno-avx512f", "-fopenmp"],
        ck.cache_dir(), key=(ck._cpu_flags(),)))))  # (build_variant's copies have no OpenMP: one thread)
    lib.tk_sgemm_min_rows(ck.NEVER)
    rows, reads = [], {}
    for model in args.models:
        r, rd = passes(lib, model, args.rows, args.threads, args.reps)
        rows += r
        reads |= rd
    ways = list(WAYS)
    print("\n| model | threads | rows | " + " | ".join(f"{w} ms (GB/s)" for w in ways)
          + " | plain read GB/s | same bits |")
    print("|---|---|---|" + "---|" * len(ways) + "---|---|")
    for r in rows:
        cells = " | ".join(f"{r[f'{w}_ms']} ({r[f'{w}_gb_s']})" if f"{w}_ms" in r else "-" for w in ways)
        read = reads[f"{r['model']} {r['threads']}"]
        print(f"| {r['model']} | {r['threads']} | {r['rows']} | {cells} | {read:.1f} | {r['same_bits']} |")
    fork = fork_join_us(lib)
    print(f"\na 32 x 128 panel linear back to back (the OpenMP fork/join at two threads): {fork} us")
    dec = decode(str(Path(args.decode).expanduser()), args.threads, args.tokens, args.rounds) if args.decode else []
    if dec:
        print("\n| model | threads | [K, N] tok/s | panels tok/s | speedup | same tokens |\n|---|---|---|---|---|---|")
        for r in dec:
            print(f"| {Path(r['model']).name} | {r['threads']} | {r['[K, N]_tok_s']} | {r['panels_tok_s']} | "
                  f"{r['speedup']:.2f}x | {r['same_tokens']} |")
    write_results(Path(args.out), {"simd": args.simd, "reps": args.reps, "load_average": os.getloadavg(),
                                   "read_gb_s": {k: round(v, 1) for k, v in reads.items()}, "rows": rows,
                                   "fork_join_us": fork, "decode": dec}, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
