"""Constrained decoding speed, before and after the exact-or-refused schema work, in one run: the tree before
it (by default the parent of the commit that added engines/schema_support.py, checked out as a temporary git
worktree and removed at the end) against this tree. Two worker processes, one per tree, load the same models
(this tree's files) and take turns, one measurement at a time, the order swapped every round: the same JSON
schema (bench/structured.py's, which both trees compile with xgrammar), prompts, seeds and token budget.
Prints constrained and unconstrained output tokens per wall second and per CPU second of the worker, per
engine and batch, the ratios new/old, and new/old of each tree's constrained/unconstrained ratio (the grammar's
own cost, apart from engine changes between the trees); writes bench/results/structured_ab.json.

    .venv/bin/python bench/structured_ab.py [--old-commit SHA] [--rounds 12] [--tokens 48]   # about 5 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL, LARGE = ROOT / "models" / "tandem-tiny-s", ROOT / "models" / "tandem-tiny-l"
CONFIGS = [("tandem-small", 1), ("tandem-small", 32), ("tandem-large+draft", 1), ("tandem-large+draft", 32)]
TAG = "AB-RESULT "  # the worker's answer lines (anything else on its stdout is log output)


def worker(tree: str, threads: int) -> None:
    """Serve measurement jobs (JSON lines on stdin) with the engines of `tree`."""
    sys.path.insert(0, tree)
    import torch

    torch.set_num_threads(threads)
    import engines
    from engines import LLM, SamplingParams
    from engines.structured import StructuredOutput

    sys.path.insert(0, str(ROOT))  # after engines: bench.structured's schema and prompts, this tree's
    from bench.structured import PROMPTS, SCHEMA

    assert Path(engines.__file__).resolve().is_relative_to(Path(tree).resolve()), engines.__file__
    llms = {"tandem-small": LLM(SMALL, name="s"), "tandem-large+draft": LLM(LARGE, name="l", draft_model=SMALL)}
    so = StructuredOutput.json_schema(SCHEMA)
    print(TAG + json.dumps({"ready": engines.__file__}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        params = [SamplingParams(temperature=0.8, seed=job["seed"] + i, max_tokens=job["tokens"],
                                 structured=so if job["constrained"] else None, ignore_eos=not job["constrained"])
                  for i in range(job["batch"])]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(job["batch"])]
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llms[job["engine"]].generate(prompts, params)
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        print(TAG + json.dumps({"tokens": tokens, "seconds": seconds, "cpu_seconds": cpu_seconds}), flush=True)


class Worker:
    def __init__(self, tree: Path, threads: int):
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", str(tree), "--threads", str(threads)],
                                     cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(tree)})
        self.engines_file = self._answer()["ready"]

    def _answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG):])
        raise RuntimeError(f"worker exited with {self.proc.wait()}")

    def run(self, **job) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def default_old_commit() -> str:
    """The parent of the commit that added engines/schema_support.py (the exact-or-refused work's first)."""
    added = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--", "engines/schema_support.py"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()[-1]
    return subprocess.run(["git", "rev-parse", added + "^"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def measure(workers: dict[str, Worker], rounds: int, tokens: int) -> dict[tuple, list[float]]:
    """Tokens per wall second and per CPU second of the worker (its threads together: what the machine's other
    load changes least) per (clock, tree, engine, batch, constrained), alternating the trees at every
    measurement."""
    rates: dict[tuple, list[float]] = {}
    for engine, batch in CONFIGS:  # warm-up: first compiles, first allocations
        for w in workers.values():
            for constrained in (False, True):
                w.run(engine=engine, batch=batch, constrained=constrained, seed=99_000, tokens=tokens)
    names = list(workers)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for engine, batch in CONFIGS:
            for constrained in (True, False):
                for tree in order:
                    out = workers[tree].run(engine=engine, batch=batch, constrained=constrained,
                                            seed=1000 * r, tokens=tokens)
                    for clock in ("seconds", "cpu_seconds"):
                        rates.setdefault((clock, tree, engine, batch, constrained), []).append(
                            out["tokens"] / out[clock])
    return rates


def _rows(rates: dict[tuple, list[float]], clock: str) -> list[dict]:
    """Per engine and batch: old and new medians and the median (and range) of the paired new/old ratios."""
    rows = []
    for engine, batch in CONFIGS:
        row: dict = {"engine": engine, "batch": batch}
        for constrained, key in ((True, "constrained"), (False, "unconstrained")):
            old_r, new_r = (rates[(clock, t, engine, batch, constrained)] for t in ("old", "new"))
            paired = [n / o for n, o in zip(new_r, old_r, strict=True)]
            row[key] = {"old_tokens_per_s": statistics.median(old_r), "new_tokens_per_s": statistics.median(new_r),
                        "new_over_old": statistics.median(paired), "new_over_old_range": [min(paired), max(paired)],
                        "old_runs": old_r, "new_runs": new_r}
        # the grammar's own share: each tree's constrained/unconstrained, new over old, paired by round
        c, u = row["constrained"], row["unconstrained"]
        rel = [(cn / un) / (co / uo) for cn, un, co, uo in zip(c["new_runs"], u["new_runs"], c["old_runs"],
                                                               u["old_runs"], strict=True)]
        row["grammar_ratio_new_over_old"] = statistics.median(rel)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--old-commit", help="the tree before (default: the parent of the commit that added "
                                         "engines/schema_support.py)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=48, help="max_tokens per request")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "structured_ab.json"))
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.threads)
        return
    sys.path.insert(0, str(ROOT))
    from bench.results_meta import write_results
    from bench.structured import SCHEMA

    old = args.old_commit or default_old_commit()
    old_tree = Path(f"/tmp/structured-ab-old-{os.getpid()}")
    subprocess.run(["git", "worktree", "add", "--detach", str(old_tree), old], cwd=ROOT, check=True,
                   capture_output=True)
    workers: dict[str, Worker] = {}
    try:
        workers = {"old": Worker(old_tree, args.threads), "new": Worker(ROOT, args.threads)}
        rates = measure(workers, args.rounds, args.tokens)
    finally:
        for w in workers.values():
            w.close()
        subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, check=True)
    tables = {clock: _rows(rates, clock) for clock in ("seconds", "cpu_seconds")}
    print(f"old tree {old}, new tree {ROOT}; median of {args.rounds} alternated rounds")
    for clock, rows in tables.items():
        print(f"\noutput tokens per {'wall' if clock == 'seconds' else 'CPU'} second")
        print(f"{'engine':<20} {'batch':>5} {'constrained old':>16} {'new':>8} {'new/old':>8} {'(range)':>13}  "
              f"{'unconstrained old':>18} {'new':>8} {'new/old':>8} {'c/u new/old':>12}")
        for r in rows:
            c, u = r["constrained"], r["unconstrained"]
            lo, hi = c["new_over_old_range"]
            print(f"{r['engine']:<20} {r['batch']:>5} {c['old_tokens_per_s']:>16.0f} {c['new_tokens_per_s']:>8.0f} "
                  f"{c['new_over_old']:>8.2f} {f'({lo:.2f}-{hi:.2f})':>13}  {u['old_tokens_per_s']:>18.0f} "
                  f"{u['new_tokens_per_s']:>8.0f} {u['new_over_old']:>8.2f} "
                  f"{r['grammar_ratio_new_over_old']:>12.2f}")
    result = {"old_commit": old, "old_engines": workers["old"].engines_file,
              "new_engines": workers["new"].engines_file, "threads": args.threads, "max_tokens": args.tokens,
              "rounds": args.rounds, "schema": SCHEMA, "per_wall_second": tables["seconds"],
              "per_cpu_second": tables["cpu_seconds"]}
    write_results(Path(args.out), result, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
