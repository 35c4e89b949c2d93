"""Speculation under open-loop arrivals, in one process: tandem-tiny-l with and without its tandem-tiny-s draft,
fed the same Poisson arrivals of chat-like requests (prompts of 60-480 tokens from held-out modules, outputs
of 5-80 tokens with min_tokens = max_tokens and ignore_eos, as `tandem loadtest` sends them; `--mix
decode_heavy`: prompts of 30-120 tokens, outputs of 64-256), the two engines
alternated per repetition. Per request: TPOT = (last token - first token) / (tokens - 1), on the engine's
own emit callback, so HTTP, tokenisation and the load generator are not in it. Reports TPOT p50 / p99 per
engine and the paired ratio (the median over requests of one request's TPOT with speculation over its TPOT
without), how many steps drafted, and both engines' busy seconds. Prints a table, writes
bench/results/spec_replay.json.

    .venv/bin/python bench/spec_replay.py [--rates 4 8] [--requests 70] [--repeats 4] [--threads 2]
        [--draft-quantization none|w8a8] [--fixed-k K] [--warmup-requests 24] [--mix chat|decode_heavy]

`--fixed-k 0` pins the speculative engine at plain decoding: an A/A run of the same code path, which shows
how far apart this machine times identical work.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
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
from engines import LLM, SamplingParams  # noqa: E402
from traces.metrics import percentiles  # noqa: E402
from training.corpus import load_corpus_split  # noqa: E402

LARGE, SMALL = ROOT / "models" / "tandem-tiny-l", ROOT / "models" / "tandem-tiny-s"
# per mix: (prompt tokens lo, hi), output lengths drawn uniformly from the list
MIXES = {
    # median 22.5 output tokens: the chat workload's, scaled to the tiny models' 512-token context
    "chat": ((60, 480), [5, 10, 15, 20, 20, 25, 30, 40, 50, 80]),
    # short prompts, long answers: the loadtest's decode_heavy_256_1024 control (1:4), scaled to 512 tokens
    "decode_heavy": ((30, 120), [64, 96, 128, 160, 192, 256]),
}


def plan(tokenizer, rate: float, n: int, seed: int, mix: str = "chat") -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt ids, output tokens) per request."""
    (lo, hi), outputs = MIXES[mix]
    rng = random.Random(seed)
    modules = [text for _, text in load_corpus_split("heldout") if len(text) > 4000]
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        text = rng.choice(modules)
        start = rng.randrange(0, len(text) - 3000)
        ids = tokenizer.encode(text[start:start + 2500])[:rng.randint(lo, hi)]
        out.append((t, ids, rng.choice(outputs)))
    return out


def replay(llm: LLM, reqs: list[tuple[float, list[int], int]], tag: str) -> tuple[dict[int, float], float, int]:
    """Serve `reqs` at their arrival times; returns (request -> TPOT s, busy seconds, drafting steps)."""
    eng = llm.engine
    first: dict[int, float] = {}
    last: dict[int, float] = {}

    def emitter(i: int):
        def emit(_out) -> None:
            now = time.perf_counter()
            first.setdefault(i, now)
            last[i] = now
        return emit

    spec = eng.speculator
    drafts0 = spec.num_drafts
    busy, nxt, t0 = 0.0, 0, time.perf_counter()
    while nxt < len(reqs) or eng.has_work():
        now = time.perf_counter() - t0
        while nxt < len(reqs) and reqs[nxt][0] <= now:
            _, ids, n = reqs[nxt]
            params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
            eng.add_request(ids, params, f"{tag}-{nxt}", emit=emitter(nxt))
            nxt += 1
        if eng.has_work():
            s = time.perf_counter()
            eng.step()
            busy += time.perf_counter() - s
        elif nxt < len(reqs):
            time.sleep(max(0.0, reqs[nxt][0] - (time.perf_counter() - t0)))
    tpot = {i: (last[i] - first[i]) / (reqs[i][2] - 1) for i in first if reqs[i][2] > 1}
    return tpot, busy, spec.num_drafts - drafts0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", type=float, nargs="+", default=[4.0, 8.0])
    ap.add_argument("--requests", type=int, default=70)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warmup-requests", type=int, default=24, help="an unmeasured replay per engine first")
    ap.add_argument("--draft-quantization", default="none", choices=["none", "int8", "w8a8"])
    ap.add_argument("--fixed-k", type=int, default=None, help="pin the speculative engine's k (0: an A/A run)")
    ap.add_argument("--mix", default="chat", choices=sorted(MIXES),
                    help="chat: 60-480 prompt tokens, 5-80 output; decode_heavy: 30-120 prompt, 64-256 output")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "spec_replay.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = LLM(LARGE, draft_model=SMALL, max_model_len=512,
               draft_options={"quantization": args.draft_quantization})
    if args.fixed_k is not None:
        spec.engine.speculator.adaptive.fixed = args.fixed_k
    plain = LLM(LARGE, max_model_len=512)
    # unmeasured: the first replay of a process runs 10-20% slower than the next ones (caches, allocators)
    warm = plan(plain.engine.tokenizer, args.rates[0], args.warmup_requests, args.seed + 1, args.mix)
    for name, llm in (("spec", spec), ("plain", plain)):
        replay(llm, warm, f"warm-{name}")
    rows = []
    for rate in args.rates:
        reqs = plan(plain.engine.tokenizer, rate, args.requests, args.seed, args.mix)
        for r in range(args.repeats):
            order = [("spec", spec), ("plain", plain)]
            runs = {name: replay(llm, reqs, f"{name}{rate}-{r}") for name, llm in (order if r % 2 == 0
                                                                                  else order[::-1])}
            (a, busy_a, drafted), (b, busy_b, _) = runs["spec"], runs["plain"]
            ratio = statistics.median(a[i] / b[i] for i in a if i in b)
            pa, pb = percentiles(a.values()), percentiles(b.values())  # the load tester's percentiles, in ms
            row = {"rate": rate, "repeat": r, "requests": len(a),
                   "tpot_p50_ms": [round(pa["p50"], 2), round(pb["p50"], 2)],
                   "tpot_p99_ms": [round(pa["p99"], 2), round(pb["p99"], 2)],
                   "paired_tpot_ratio": round(ratio, 3), "drafting_steps": drafted,
                   "busy_s": [round(busy_a, 2), round(busy_b, 2)]}
            rows.append(row)
            print(f"rate {rate:g} repeat {r}: TPOT p50 {row['tpot_p50_ms']} p99 {row['tpot_p99_ms']} ms (spec, plain), "
                  f"paired ratio {ratio:.3f}, drafting steps {drafted}, busy {row['busy_s']} s", flush=True)
    print("\n| rate req/s | repeat | TPOT p50 ms spec / plain | TPOT p99 ms spec / plain | paired TPOT ratio | "
          "drafting steps | busy s spec / plain |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rate']:g} | {r['repeat']} | {r['tpot_p50_ms'][0]} / {r['tpot_p50_ms'][1]} | "
              f"{r['tpot_p99_ms'][0]} / {r['tpot_p99_ms'][1]} | {r['paired_tpot_ratio']} | {r['drafting_steps']} | "
              f"{r['busy_s'][0]} / {r['busy_s'][1]} |")
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    meta = {"command": " ".join(sys.argv), "git_commit": git, "threads": args.threads,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.1f}",
            "draft_quantization": args.draft_quantization, "fixed_k": args.fixed_k, "mix": args.mix}
    write_results(Path(args.out), {"meta": meta, "rows": rows}, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
