"""The cost of a stream's outputs: one `OutputProcessor.build` per generated token for a request of 4,000 output
tokens with logprobs (top 5), as the engine builds them, in this tree and in another checkout (`--base`, the
same script run there in a subprocess). Before outputs became deltas plus views each build copied the whole
token list and logprobs (O(n) an output, O(n^2) a stream). Prints a table, writes
bench/results/stream_outputs.json.

    .venv/bin/python bench/stream_outputs.py [--base /path/to/other/checkout] [--tokens 4000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench.results_meta import write_results  # noqa: E402

MEASURE = r'''
import json, sys, time
from engines.output_processor import OutputProcessor
from engines.outputs import Logprob
from engines.sampling_params import SamplingParams
from engines.sequence import Request, Sequence
tokens, reps = int(sys.argv[1]), int(sys.argv[2])
best_total, last = None, None
for _ in range(reps):
    prompt = list(range(100))
    req = Request("r", None, prompt, SamplingParams(max_tokens=tokens, logprobs=5))
    seq = Sequence(req, 0, list(prompt), len(prompt), len(prompt) + tokens)
    seq.logprobs = []
    req.seqs.append(seq)
    proc = OutputProcessor("m", None)
    times = []
    for i in range(tokens):
        seq.token_ids.append(i % 300)
        seq.logprobs.append({i % 300: Logprob(-0.5, 1), **{t: Logprob(-2.0, r + 2) for r, t in enumerate(range(5))}})
        seq.text += "ab"
        t0 = time.perf_counter()
        out = proc.build(req, False)
        times.append(time.perf_counter() - t0)
        assert out.outputs[0].delta_token_ids == [i % 300]
    total = sum(times)
    if best_total is None or total < best_total:
        best_total, last = total, sum(times[-500:]) / 500
print(json.dumps({"total_s": best_total, "last_500_us_per_output": last * 1e6}))
'''


def measure(tree: Path, tokens: int, reps: int) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, str(tokens), str(reps)], cwd=tree, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=None, help="another checkout to measure beside this one")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=3, help="runs per tree; the fastest counts")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "stream_outputs.json"))
    args = ap.parse_args(argv)
    trees = ([("base", Path(args.base))] if args.base else []) + [("this", ROOT)]
    rows = []
    for name, tree in trees:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True,
                                text=True).stdout.strip()
        r = measure(tree, args.tokens, args.reps)
        rows.append({"tree": name, "commit": commit, **r})
        print(f"{name:5s} {commit}: {args.tokens} outputs in {r['total_s'] * 1e3:8.1f} ms, the last 500 at "
              f"{r['last_500_us_per_output']:7.1f} us each")
    result = {"bench": "stream_outputs", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "tokens": args.tokens, "rows": rows}
    write_results(Path(args.out), result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
