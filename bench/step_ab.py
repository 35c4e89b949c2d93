"""Decode speed of this tree's engine against another checkout's (e.g. the commit before a refactor of the step),
in one run: one worker process per tree (each imports its own `engines`), the same prompts and settings,
alternated round by round with the order swapped every round. Output tokens per thread CPU-second (one torch
thread; CPU time, not wall time, since the machine is shared) for greedy decoding (multi-token steps), seeded
sampling at T = 0.8 (sampler steps) and speculative greedy decoding with the small draft model, at batch 1, 8
and 32; `--control` adds a second worker of the base tree, whose ratio to the first is what noise and a
worker's place in the order alone give. Prints a table, writes bench/results/step_ab.json.

    .venv/bin/python bench/step_ab.py --base /path/to/other/checkout [--control] [--rounds 6] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench.results_meta import write_results  # noqa: E402

WORKER = r'''
import json, sys, time
import torch
torch.set_num_threads(1)
from bench.speculative import prompts_from_heldout, run
from engines import LLM, SamplingParams
plain = LLM("models/tandem-tiny-l", max_num_seqs=64)
spec = LLM("models/tandem-tiny-l", draft_model="models/tandem-tiny-s", num_speculative_tokens=4, max_num_seqs=64)
prompts = {b: prompts_from_heldout(plain.tokenizer, b, 64, seed=b) for b in (1, 8, 32)}
print("ready", flush=True)
for line in sys.stdin:
    mode, batch, max_tokens = line.split()
    batch, max_tokens = int(batch), int(max_tokens)
    llm = spec if mode == "spec" else plain
    temp, seed = (0.8, 7) if mode == "seeded" else (0.0, None)
    params = SamplingParams(temperature=temp, seed=seed, max_tokens=max_tokens, ignore_eos=True)
    _, cpu, n, _ = run(llm, prompts[batch], params)
    print(json.dumps({"tok_per_cpu_s": n / cpu, "tokens": n}), flush=True)
'''


class Worker:
    def __init__(self, tree: Path):
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER], cwd=tree, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def rate(self, mode: str, batch: int, max_tokens: int) -> float:
        self.proc.stdin.write(f"{mode} {batch} {max_tokens}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["tok_per_cpu_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the other checkout (its engines/ and models/ are used)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--modes", nargs="+", default=["greedy", "seeded", "spec"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--control", action="store_true",
                    help="a second worker of the base tree beside the first: the ratio two equal engines show")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "step_ab.json"))
    args = ap.parse_args(argv)
    workers = {"base": Worker(Path(args.base)), "this": Worker(ROOT)}
    if args.control:
        workers["control"] = Worker(Path(args.base))
    rows = []
    try:
        for mode in args.modes:
            for b in args.batches:
                for w in workers.values():  # warm-up
                    w.rate(mode, b, args.max_tokens)
                got: dict[str, list[float]] = {name: [] for name in workers}
                names = list(workers)
                for r in range(args.rounds):  # each round in another order: none always goes first
                    for name in names[r % len(names):] + names[:r % len(names)]:
                        got[name].append(workers[name].rate(mode, b, args.max_tokens))
                row = {"mode": mode, "batch": b}
                for name in names:
                    row[f"{name}_tok_per_cpu_s"] = statistics.median(got[name])
                for name in names[1:]:
                    ratios = [t / s for t, s in zip(got[name], got["base"])]
                    row[f"{name}_ratio"] = statistics.median(ratios)
                    row[f"{name}_ratio_range"] = [min(ratios), max(ratios)]
                rows.append(row)
                print(f"{mode:7s} batch {b:3d}: base {row['base_tok_per_cpu_s']:7.0f} tok/cpu-s  " + "  ".join(
                    f"{name} {row[f'{name}_ratio']:.3f} [{row[f'{name}_ratio_range'][0]:.3f}, "
                    f"{row[f'{name}_ratio_range'][1]:.3f}]" for name in names[1:]), flush=True)
    finally:
        for w in workers.values():
            w.close()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    base_commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.base, capture_output=True,
                                 text=True).stdout
    out = {"bench": "step_ab", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit.strip(),
           "base_commit": base_commit.strip(), "machine": {"cpu": platform.processor() or platform.machine()},
           "rounds": args.rounds, "max_tokens": args.max_tokens, "rows": rows}
    write_results(Path(args.out), out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
