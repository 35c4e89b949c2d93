"""One-stream decode against the machine's streaming bandwidth, both read within the same tens of milliseconds:
the engine (as `tandem serve` builds it, one sequence, greedy, its default multi-token steps) takes a step, then
one thread-count-matched torch.sum reads a huge-page buffer of the same bytes as many times as the step made
tokens; each pair's share is the read's seconds over the step's. On a shared VM whose bandwidth moves between
~30 and ~68 GB/s from one minute to the next (two threads), a share against a reading taken seconds or minutes
away measures the minute as much as the kernels; a pair sees one minute. The cell's share is the median over
pairs, with its 10th / 90th percentiles.

Bytes per token are what bench/vs_llamacpp.py's `tandem_bytes` counts (every layer projection and the tied
head once, in the format read). Each cell runs in a fresh process with TANDEM_THREADS set (the thread count
fixed, as the server bench sets it). The random Llamas are bench/vs_llamacpp.py's, built once into its cache.
Prints a table, writes bench/results/decode_share.json.

    .venv/bin/python bench/decode_share.py [--models llama200m,llama1b] [--quant f32,bf16,8bit,int4]
        [--threads 1 2] [--steps 60]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402
from bench.vs_llamacpp import CACHE, RANDOM_LLAMAS, bf16_variant, random_llama, tandem_bytes  # noqa: E402

QUANT = {"f32": "none", "bf16": "bf16", "8bit": "w8a8", "int4": "int4"}


def checkpoint(name: str, quant: str) -> Path:
    work = CACHE / "vs_llamacpp"
    folder = random_llama(work / name, name)
    return bf16_variant(folder, work / f"{name}-bf16") if quant == "bf16" else folder


def run_cell(name: str, quant: str, steps: int) -> dict:
    """In this process (TANDEM_THREADS already set): `steps` decode steps, each paired with its reads."""
    import random

    import torch

    from engines import LLM, SamplingParams
    from kernels import hugepages

    folder = checkpoint(name, quant)
    nbytes = int(tandem_bytes(folder, quant)["tandem_bytes"])
    llm = LLM(str(folder), quantization=QUANT[quant], max_model_len=2048)
    eng = llm.engine
    gc.collect()
    gc.freeze()  # as `tandem serve` does once its engines are up: no collector pass over torch's objects mid-decode
    buf = hugepages.empty((nbytes // 4,), torch.float32)
    buf.fill_(1.0)
    float(buf.sum())
    rng = random.Random(0)
    req = eng.add_request([rng.randrange(5, 4000) for _ in range(64)],
                          SamplingParams(max_tokens=8 * steps + 16, temperature=0.0, ignore_eos=True))

    def made() -> int:
        return sum(s.num_output_tokens for s in req.seqs)

    while made() < 1:  # the prompt's prefill: not decode
        eng.step()
    for _ in range(3):
        eng.step()
    pairs = []
    for _ in range(steps):
        n0 = made()
        t0 = time.perf_counter()
        eng.step()
        t1 = time.perf_counter()
        tokens = made() - n0
        for _ in range(tokens):
            float(buf.sum())
        t2 = time.perf_counter()
        if tokens:
            pairs.append({"tokens": tokens, "step_s": t1 - t0, "read_s": t2 - t1})
    shares = [p["read_s"] / p["step_s"] for p in pairs]
    dec = sorted(p["tokens"] * nbytes / p["step_s"] / 1e9 for p in pairs)
    ref = sorted(p["tokens"] * nbytes / p["read_s"] / 1e9 for p in pairs)
    q = statistics.quantiles(shares, n=10)
    # the pairs whose reading was above the cell's median reading (the machine's faster minutes) and the rest
    cut = statistics.median(p["read_s"] / p["tokens"] for p in pairs)
    fast = [x for x, p in zip(shares, pairs) if p["read_s"] / p["tokens"] < cut] or shares
    slow = [x for x, p in zip(shares, pairs) if p["read_s"] / p["tokens"] >= cut] or shares
    return {"model": name, "quant": quant, "threads": torch.get_num_threads(), "bytes_per_token": nbytes,
            "pairs": len(pairs), "tokens_per_step": statistics.median(p["tokens"] for p in pairs),
            "share": statistics.median(shares), "share_p10": q[0], "share_p90": q[-1],
            "share_fast_half": statistics.median(fast), "share_slow_half": statistics.median(slow),
            "decode_gb_s": statistics.median(dec), "stream_gb_s": statistics.median(ref),
            "ms_per_token": 1e3 * statistics.median(p["step_s"] / p["tokens"] for p in pairs), "raw": pairs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama200m,llama1b", help="comma list of: " + ", ".join(RANDOM_LLAMAS))
    ap.add_argument("--quant", default="f32,bf16,8bit,int4", help="comma list of: " + ", ".join(QUANT))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=60, help="decode steps (pairs) per cell")
    ap.add_argument("--cell", default=None, help=argparse.SUPPRESS)  # model,quant: run one cell, print JSON
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_share.json"))
    args = ap.parse_args(argv)
    if args.cell:
        name, quant = args.cell.split(",")
        print("CELL " + json.dumps(run_cell(name, quant, args.steps)), flush=True)
        return 0
    cells = []
    for name in args.models.split(","):
        for quant in args.quant.split(","):
            for threads in args.threads:
                env = dict(os.environ, TANDEM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
                if quant == "f32":  # float32 weights read as float32 (not the bf16 copies of bf16-exact values)
                    env["TANDEM_CPU_BF16_WEIGHTS"] = "0"
                out = subprocess.run([sys.executable, __file__, "--cell", f"{name},{quant}", "--steps",
                                      str(args.steps)], env=env, cwd=ROOT, capture_output=True, text=True)
                line = next((x for x in out.stdout.splitlines() if x.startswith("CELL ")), None)
                if out.returncode or line is None:
                    raise RuntimeError(f"{name} {quant} t{threads}: {out.stderr[-2000:]}")
                c = json.loads(line[5:])
                cells.append(c)
                print(f"{name} {quant} t{threads}: share {c['share']:.3f} (p10 {c['share_p10']:.2f}, p90 "
                      f"{c['share_p90']:.2f}; faster / slower half of the readings {c['share_fast_half']:.2f} / "
                      f"{c['share_slow_half']:.2f}) decode {c['decode_gb_s']:.1f} GB/s, stream {c['stream_gb_s']:.1f} "
                      f"GB/s, {c['ms_per_token']:.2f} ms/token, {c['tokens_per_step']:g} tokens/step, load "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
    print("\n| model | weights | threads | share of streaming (p10-p90) | faster / slower half | decode GB/s "
          "| stream GB/s | ms/token |")
    print("|---|---|---|---|---|---|---|---|")
    for c in cells:
        print(f"| {c['model']} | {c['quant']} | {c['threads']} | {c['share']:.3f} ({c['share_p10']:.2f}-"
              f"{c['share_p90']:.2f}) | {c['share_fast_half']:.2f} / {c['share_slow_half']:.2f} | "
              f"{c['decode_gb_s']:.1f} | {c['stream_gb_s']:.1f} | {c['ms_per_token']:.2f} |")
    write_results(Path(args.out), {"config": vars(args), "cells": cells, "loadavg_end": os.getloadavg()}, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
