"""Decode on a shared machine: ms per token of one greedy stream on a random ~80M Llama (bench/vs_llamacpp.py's
llama80m), with the default thread count, alone and beside busy-loop neighbour processes (each holds a core),
alternated round by round. Prints a table with the load average before each run and writes
bench/results/cpu_threads.json. A busy neighbour on a 2-core machine should cost at most its share (about 2x).

    .venv/bin/python bench/cpu_threads.py [--neighbours 0 1] [--threads 0] [--max-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench.results_meta import write_results  # noqa: E402


def _spin() -> None:  # the neighbour: one busy loop holding a core
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: the random llama80m)")
    ap.add_argument("--neighbours", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--threads", type=int, nargs="+", default=[0, 2],
                    help="engine thread settings to compare (0: the default, adapting; N: fixed)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_threads.json"))
    args = ap.parse_args(argv)
    from bench.vs_llamacpp import CACHE, llama80m
    from engines import LLM, SamplingParams

    folder = Path(args.model) if args.model else llama80m(CACHE / "bench-models" / "llama80m")
    rows = []
    print(f"{folder.name}, {args.max_tokens} tokens, {os.cpu_count()} CPUs")
    print(f"{'threads':>8} {'neighbours':>10} {'best ms/tok':>12} {'median':>8} {'slowdown':>8} {'loadavg':>8}")
    for setting in args.threads:
        llm = LLM(folder, max_model_len=512, threads=setting)
        threads = llm.core.threads
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        prompt = {"prompt_token_ids": list(range(5, 37))}
        llm.generate(prompt, sp)  # warm
        runs: dict[int, list[dict]] = {n: [] for n in args.neighbours}
        for _ in range(args.rounds):
            for n in args.neighbours:
                procs = [mp.Process(target=_spin, daemon=True) for _ in range(n)]
                for p in procs:
                    p.start()
                time.sleep(0.5 if n else 0.0)
                load = os.getloadavg()[0]
                t = time.perf_counter()
                llm.generate(prompt, sp)
                ms = (time.perf_counter() - t) * 1e3 / args.max_tokens
                for p in procs:
                    p.kill()
                    p.join()
                runs[n].append({"ms_per_token": round(ms, 2), "loadavg_1m": round(load, 2)})
        base = None
        for n, rs in runs.items():
            ms = sorted(r["ms_per_token"] for r in rs)
            med = ms[len(ms) // 2]
            base = base or med
            row = {"threads_setting": setting, "threads": threads, "adaptive": setting == 0, "neighbours": n,
                   "best_ms_per_token": ms[0], "median_ms_per_token": med,
                   "slowdown_vs_no_neighbour": round(med / base, 2), "runs": rs}
            rows.append(row)
            print(f"{('auto ' if setting == 0 else '') + str(threads):>8} {n:>10} {ms[0]:>12.2f} {med:>8.2f} "
                  f"{med / base:>8.2f} {max(r['loadavg_1m'] for r in rs):>8.2f}")
        del llm
    write_results(args.out, {"model": folder.name, "max_tokens": args.max_tokens, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
