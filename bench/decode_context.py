"""One-stream decode against the context length: the engine as `tandem serve` builds it (one sequence, greedy, its
default multi-token steps) decoding after prompts of `--prompts` tokens, ms per token and the bytes a token reads
(the weights as bench/decode_share.py counts them, plus every layer's K and V rows of the context, in the cache's
dtype) per second. With `--base REV` the same cells run from a temporary git worktree of REV too, alternated with
this tree's `--rounds` times, each cell in a fresh process, and the report gives each tree's median and their ratio
(this tree over the base: below 1 is faster). With two `--kv` cache dtypes (`kv_cache_dtype`: float32, bfloat16,
float16) instead, the two caches alternate and the ratio is the second's time over the first's. The random Llamas
are bench/vs_llamacpp.py's. Writes bench/results/decode_context.json (or `--out`).

    .venv/bin/python bench/decode_context.py [--models llama200m] [--quant int4,f32] [--threads 1 2]
        [--prompts 64 1000 2000] [--base HEAD | --kv float32 bfloat16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402

DECODE = 64  # tokens timed per prompt, after WARM
WARM = 8


def run_cell(name: str, quant: str, prompts: list[int], kv: str = "float32") -> dict:
    """In this process (TANDEM_THREADS set, this tree first on sys.path): each prompt's decode."""
    import gc
    import random

    from bench.decode_share import QUANT, checkpoint
    from bench.vs_llamacpp import RANDOM_LLAMAS, tandem_bytes
    from engines import LLM, SamplingParams

    folder = checkpoint(name, quant)
    weights = int(tandem_bytes(folder, quant)["tandem_bytes"])
    h, layers, nh, nkv, _ = RANDOM_LLAMAS[name]
    kv_per_key = layers * 2 * nkv * (h // nh) * (4 if kv == "float32" else 2)
    llm = LLM(str(folder), quantization=QUANT[quant], max_model_len=max(prompts) + DECODE + WARM + 64,
              kv_cache_dtype=kv)
    eng = llm.engine
    gc.collect()
    gc.freeze()
    rng = random.Random(0)
    out = []
    for plen in prompts:
        req = eng.add_request([rng.randrange(5, 4000) for _ in range(plen)],
                              SamplingParams(max_tokens=WARM + DECODE, temperature=0.0, ignore_eos=True))

        def made(req=req) -> int:
            return sum(s.num_output_tokens for s in req.seqs)

        while made() < WARM:
            eng.step()
        n0, t0 = made(), time.perf_counter()
        while not req.finished:
            eng.step()
        dt, n = time.perf_counter() - t0, made() - n0
        mean_ctx = plen + (WARM + made()) / 2
        out.append({"prompt": plen, "tokens": n, "ms_per_token": 1e3 * dt / n,
                    "weights_bytes": weights, "kv_bytes_per_token": int(mean_ctx * kv_per_key),
                    "gb_s": (weights + mean_ctx * kv_per_key) * n / dt / 1e9})
    return {"model": name, "quant": quant, "kv": kv, "cells": out}


def cell_process(tree: Path, name: str, quant: str, threads: int, prompts: list[int], kv: str = "float32") -> dict:
    env = dict(os.environ, TANDEM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    if quant == "f32":
        env["TANDEM_CPU_BF16_WEIGHTS"] = "0"
    script = Path(__file__)  # this file's cell runner over `tree`'s code (a base's own may predate its options)
    cmd = [sys.executable, str(script), "--cell", f"{name},{quant}", "--tree", str(tree), "--prompts",
           *map(str, prompts), *(["--kv", kv] if kv != "float32" else [])]
    res = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    line = next((x for x in res.stdout.splitlines() if x.startswith("CELL ")), None)
    if res.returncode or line is None:
        raise RuntimeError(f"{tree} {name} {quant} t{threads}: {res.stderr[-2000:]}")
    return json.loads(line[5:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama200m")
    ap.add_argument("--quant", default="int4,f32", help="comma list of: f32, bf16, 8bit, int4")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prompts", type=int, nargs="+", default=[64, 1000, 2000])
    ap.add_argument("--base", default=None, help="a git revision to compare with, from a temporary worktree")
    ap.add_argument("--kv", nargs="+", default=["float32"], choices=("float32", "bfloat16", "float16"),
                    help="the cache's dtype; two: both alternated, the ratio the second's over the first's")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each cell per tree (alternated)")
    ap.add_argument("--cell", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tree", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_context.json"))
    args = ap.parse_args(argv)
    if args.cell:
        if args.tree:
            sys.path.insert(0, args.tree)
        name, quant = args.cell.split(",")
        print("CELL " + json.dumps(run_cell(name, quant, args.prompts, args.kv[0])), flush=True)
        return 0
    if args.base and len(args.kv) > 1:
        ap.error("--base compares trees over one cache dtype: give one --kv with it")
    trees = {"tree": ROOT}
    tmp = None
    if args.base:
        tmp = Path(tempfile.mkdtemp(prefix="decode_context_base_"))
        subprocess.run(["git", "worktree", "add", "--detach", str(tmp / "wt"), args.base], cwd=ROOT, check=True,
                       capture_output=True)
        trees = {"base": tmp / "wt", "tree": ROOT}
    base_rev = (subprocess.run(["git", "rev-parse", args.base], cwd=ROOT, check=True, capture_output=True,
                               text=True).stdout.strip() if args.base else None)
    rows = []
    try:
        for name in args.models.split(","):
            for quant in args.quant.split(","):
                for threads in args.threads:
                    # (label, tree, cache dtype): the trees over one dtype, or this tree over each dtype
                    variants = ([(k, t, args.kv[0]) for k, t in trees.items()] if len(args.kv) == 1
                                else [(kv, ROOT, kv) for kv in args.kv])
                    runs: dict[str, list[dict]] = {k: [] for k, _, _ in variants}
                    for _ in range(args.rounds):
                        for key, tree, kv in variants:
                            runs[key].append(cell_process(tree, name, quant, threads, args.prompts, kv))
                    for i, plen in enumerate(args.prompts):
                        row = {"model": name, "quant": quant, "threads": threads, "prompt": plen}
                        for key in runs:
                            cells = [r["cells"][i] for r in runs[key]]
                            row[key] = {"ms_per_token": statistics.median(c["ms_per_token"] for c in cells),
                                        "gb_s": statistics.median(c["gb_s"] for c in cells),
                                        "runs_ms": [round(c["ms_per_token"], 3) for c in cells],
                                        "kv_bytes_per_token": cells[0]["kv_bytes_per_token"],
                                        "weights_bytes": cells[0]["weights_bytes"]}
                        first, last = list(runs)[0], list(runs)[-1]
                        if first != last:
                            row["ratio"] = row[last]["ms_per_token"] / row[first]["ms_per_token"]
                        rows.append(row)
                        msg = (f"{name} {quant} t{threads} prompt {plen}: {last} {row[last]['ms_per_token']:.2f} "
                               f"ms/token ({row[last]['gb_s']:.1f} GB/s of weights + KV)")
                        if first != last:
                            msg += (f", {first} {row[first]['ms_per_token']:.2f} ms/token, ratio "
                                    f"{row['ratio']:.2f}")
                        print(msg + f", load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        if tmp is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "wt")], cwd=ROOT, capture_output=True)
            shutil.rmtree(tmp, ignore_errors=True)
    write_results(Path(args.out), {"config": vars(args), "base_commit": base_rev, "rows": rows,
                                   "loadavg_end": os.getloadavg()}, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
