"""Cold prefill on the CPU: prompt tokens/s of one request (max_tokens 1, chunked prefill in 512-token chunks,
prefix caching off, a fresh random prompt each run) on the random ~80M Llama of bench/vs_llamacpp.py, at the
default (adaptive) threads. tandem alone: llama.cpp's side is bench/vs_llamacpp.py's when llama-server is built.
Prints a table with the load average and writes bench/results/cpu_prefill.json.

    .venv/bin/python bench/cpu_prefill.py [--lengths 400 512 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench.results_meta import write_results  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[400, 512, 2000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_prefill.json"))
    args = ap.parse_args(argv)
    from bench.vs_llamacpp import CACHE, llama80m
    from engines import LLM, SamplingParams

    folder = llama80m(CACHE / "bench-models" / "llama80m")
    llm = LLM(folder, max_model_len=2048, threads=args.threads, enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size if hasattr(llm.engine, "model_config") else 4096
    prompt = lambda n: {"prompt_token_ids": [rng.randrange(5, vocab) for _ in range(n)]}  # noqa: E731
    llm.generate(prompt(600), sp)  # warm
    rows = []
    print(f"{folder.name}, threads {llm.core.threads} ({'adaptive' if args.threads == 0 else 'fixed'})")
    print(f"{'tokens':>7} {'best s':>8} {'tok/s':>8} {'loadavg':>8}")
    for n in args.lengths:
        secs = []
        load = os.getloadavg()[0]
        for _ in range(args.repeats):
            p = prompt(n)
            t = time.perf_counter()
            llm.generate(p, sp)
            secs.append(time.perf_counter() - t)
        best = min(secs)
        rows.append({"prompt_tokens": n, "best_s": round(best, 4), "prompt_tok_per_s": round(n / best, 1),
                     "runs_s": [round(s, 4) for s in secs], "loadavg_1m": round(load, 2)})
        print(f"{n:>7} {best:>8.3f} {n / best:>8.0f} {load:>8.2f}")
    write_results(args.out, {"model": folder.name, "threads": llm.core.threads, "adaptive": args.threads == 0,
                             "llama_cpp": "not measured: llama-server is not built on this machine", "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
