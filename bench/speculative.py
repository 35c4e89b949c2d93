"""Speculative decoding on the default tiny pair (tandem-tiny-s drafts for tandem-tiny-l, the draft in w8a8 by
default, the target float32): output tokens/s
with and without speculation at batch 1, 8 and 32, greedy and temperature 0.8, side by side in one process,
with acceptance rate, mean accepted length and the k adaptive k settled on. Prompts are windows of held-out
standard-library modules (the models' own domain); batch 1 serves `--batch1-prompts` of them one after another.
Prints a table, writes bench/results/speculative.json.

    .venv/bin/python bench/speculative.py [--batches 1 8 32] [--max-tokens 128] [--repeats 3] [--threads 1]
        [--batched-repeats N] [--draft-quantization w8a8|none|int8] [--target tiny-l|wide] [--wide-factor 5]

`--target wide`: the target is training/widen.py's function-preserving widening of tandem-tiny-l (built into
the cache on first use; same predictions, so tiny-s keeps its real acceptance, at ~21x the bytes: decode bound
by memory bandwidth, the regime speculation pays in); results default to bench/results/speculative_wide.json.

The speedup is the median over back-to-back pairs, plain first in even pairs and speculative first in odd ones
(use an even --repeats); q1-q3 is the quartile range of the pairs, the spread this machine times the two
engines with.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402
from engines import LLM, SamplingParams  # noqa: E402
from kernels.cpu_kernels import simd_level  # noqa: E402
from training.corpus import load_corpus_split  # noqa: E402
from training.widen import DEFAULT_FACTOR, cached_wide  # noqa: E402

LARGE, SMALL = ROOT / "models" / "tandem-tiny-l", ROOT / "models" / "tandem-tiny-s"


def prompts_from_heldout(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """n windows of `length` tokens, each starting at a line start of a held-out module."""
    rng = random.Random(seed)
    modules = [text for _, text in load_corpus_split("heldout") if len(text) > 4000]
    out = []
    while len(out) < n:
        text = rng.choice(modules)
        start = text.rfind("\n", 0, rng.randrange(0, len(text) - 3000)) + 1
        ids = tokenizer.encode(text[start:start + 2000])
        if len(ids) >= length:
            out.append(ids[:length])
    return out


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float, int, list[int]]:
    """Every prompt at once; returns (wall seconds, CPU seconds of this thread, output tokens, the k adaptive
    k held after each step)."""
    eng = llm.engine
    spec = eng.speculator
    ks: list[int] = []
    for i, p in enumerate(prompts):
        eng.add_request(p, params, f"b{time.monotonic_ns()}-{i}")
    t0, c0 = time.perf_counter(), time.thread_time()
    n0 = eng.num_generated_tokens
    while eng.has_work():
        eng.step()
        if spec.drafter is not None:
            ks.append(spec.adaptive.k)
    return time.perf_counter() - t0, time.thread_time() - c0, eng.num_generated_tokens - n0, ks


def run_batch(llm: LLM, prompts: list[list[int]], params: SamplingParams, batch: int
              ) -> tuple[float, float, int, list[int]]:
    """`run` over the prompts in groups of `batch` requests, one group after another (batch 1 sees several
    prompts, not one: a sampled continuation of a single prompt swings the acceptance by +-0.1)."""
    total = [0.0, 0.0, 0, []]
    for i in range(0, len(prompts), batch):
        dt, dc, n, ks = run(llm, prompts[i:i + batch], params)
        total[0] += dt
        total[1] += dc
        total[2] += n
        total[3] += ks
    return total[0], total[1], total[2], total[3]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--batched-repeats", type=int, default=None,
                    help="pairs at batches > 1 (default --repeats): the ratio there is ~1 and needs more pairs to tell")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (max k)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch1-prompts", type=int, default=6, help="prompts served one after another at batch 1")
    ap.add_argument("--draft-quantization", default="w8a8", choices=["none", "int8", "w8a8"],
                    help="the draft model's quantization (the target, and so every output, stays float32; a "
                         "w8a8 draft's passes cost about half a float32 one's)")
    ap.add_argument("--target", default="tiny-l", choices=["tiny-l", "wide"])
    ap.add_argument("--wide-factor", type=int, default=DEFAULT_FACTOR)
    ap.add_argument("--out", default=None, help="default bench/results/speculative.json (speculative_wide.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = LARGE if args.target == "tiny-l" else cached_wide(args.wide_factor)
    args.out = args.out or str(ROOT / "bench" / "results" /
                               ("speculative.json" if args.target == "tiny-l" else "speculative_wide.json"))
    load0 = os.getloadavg()

    plain = LLM(target, max_num_seqs=64)
    spec = LLM(target, draft_model=SMALL, num_speculative_tokens=args.k, max_num_seqs=64,
               draft_options={"quantization": args.draft_quantization})
    tok = plain.tokenizer
    warm = prompts_from_heldout(tok, 2, args.prompt_tokens, seed=99)
    for llm in (plain, spec):  # warm-up: allocator, first-call overheads, and adaptive k's first measurements
        llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(temperature=0, max_tokens=64))

    rows = []
    for temp in (0.0, 0.8):
        for b in args.batches:
            prompts = prompts_from_heldout(tok, b if b > 1 else args.batch1_prompts, args.prompt_tokens, seed=b)
            params = SamplingParams(temperature=temp, max_tokens=args.max_tokens, ignore_eos=True)
            t_plain, t_spec, c_plain, c_spec, ks = [], [], [], [], Counter()
            run(plain, prompts[:b], params)  # warm-up at this batch: first touches of pool pages, allocator growth
            run(spec, prompts[:b], params)
            before = spec.engine.speculator.stats()
            reps = args.repeats if b == 1 or args.batched_repeats is None else args.batched_repeats
            for rep in range(reps):  # alternate so both see the same background load, and swap which goes first
                # each pair (the second of two runs measured 1-3% slower than the first with two identical plain
                # engines: a fixed order biases the ratio)
                for llm in ((plain, spec) if rep % 2 == 0 else (spec, plain)):
                    dt, dc, n, k_steps = run_batch(llm, prompts, params, b)
                    (t_spec if llm is spec else t_plain).append(n / dt)
                    (c_spec if llm is spec else c_plain).append(n / dc)
                    if llm is spec:
                        ks.update(k_steps)
            after = spec.engine.speculator.stats()
            drafts = after["spec_num_drafts"] - before["spec_num_drafts"]
            draft_toks = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
            accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
            p_med, s_med = statistics.median(t_plain), statistics.median(t_spec)
            pc_med, sc_med = statistics.median(c_plain), statistics.median(c_spec)
            # speedups: the median over back-to-back (plain, speculative) pairs, robust to load drifting
            ratios = sorted(s / p for s, p in zip(t_spec, t_plain))
            pair = statistics.median(ratios)
            q1, q3 = (statistics.quantiles(ratios, n=4)[0::2] if len(ratios) > 1 else (ratios[0], ratios[0]))
            pair_cpu = statistics.median(s / p for s, p in zip(c_spec, c_plain))
            rows.append({
                "temperature": temp, "batch": b, "plain_tokens_per_s": round(p_med, 1),
                "spec_tokens_per_s": round(s_med, 1), "speedup": round(pair, 3),
                "speedup_q1": round(q1, 3), "speedup_q3": round(q3, 3), "pair_ratios": [round(x, 3) for x in ratios],
                "plain_tokens_per_cpu_s": round(pc_med, 1), "spec_tokens_per_cpu_s": round(sc_med, 1),
                "speedup_cpu": round(pair_cpu, 3),
                "acceptance_rate": round(accepted / draft_toks, 3) if draft_toks else None,
                "mean_accepted_length": round((accepted + drafts) / drafts, 3) if drafts else None,
                "k_steps": dict(sorted(ks.items())), "plain_runs": [round(x, 1) for x in t_plain],
                "spec_runs": [round(x, 1) for x in t_spec]})
            r = rows[-1]
            print(f"temp {temp:<4} batch {b:>3}: plain {r['plain_tokens_per_s']:>8.1f} tok/s  spec "
                  f"{r['spec_tokens_per_s']:>8.1f} tok/s  {r['speedup']:.2f}x (per CPU-s {r['speedup_cpu']:.2f}x)  accept {r['acceptance_rate']}  "
                  f"mean len {r['mean_accepted_length']}  k per step {r['k_steps']}", flush=True)

    # the ceiling adaptive k works under: every fixed k at batch 1, greedy (alternating with plain runs)
    sweep = []
    prompts = prompts_from_heldout(tok, 1, args.prompt_tokens, seed=1)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    run(plain, prompts, params)
    for k in range(0, args.k + 1):
        spec.engine.speculator.adaptive.fixed = k
        run(spec, prompts, params)
        before = spec.engine.speculator.stats()
        ratios, cpu_ratios = [], []
        for rep in range(args.repeats):
            if rep % 2 == 0:
                dt_p, dc_p, n_p, _ = run(plain, prompts, params)
                dt_s, dc_s, n_s, _ = run(spec, prompts, params)
            else:
                dt_s, dc_s, n_s, _ = run(spec, prompts, params)
                dt_p, dc_p, n_p, _ = run(plain, prompts, params)
            ratios.append((n_s / dt_s) / (n_p / dt_p))
            cpu_ratios.append((n_s / dc_s) / (n_p / dc_p))
        after = spec.engine.speculator.stats()
        drafts = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
        acc = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
        sweep.append({"k": k, "speedup": round(statistics.median(ratios), 3),
                      "speedup_cpu": round(statistics.median(cpu_ratios), 3),
                      "acceptance_rate": round(acc / drafts, 3) if drafts else None})
        print(f"fixed k={k}, batch 1, greedy: {sweep[-1]}", flush=True)
    spec.engine.speculator.adaptive.fixed = None
    cost = spec.engine.speculator.adaptive
    measured = {"target_step_seconds_by_tokens": {round(x, 1): y for x, y in sorted(cost.target.points.values())},
                "draft_pass_seconds_by_seqs": {round(x, 1): y for x, y in sorted(cost.draft.points.values())}}
    one = cost.target.estimate(1)
    # the verify pass of one sequence's k + 1 rows over a plain decode pass of one row (the target's own
    # pass timings, on the engine's step clock), and a draft pass over a target pass
    measured["verify_over_decode_pass"] = {k: round(cost.target.estimate(k + 1) / one, 3)
                                           for k in range(1, args.k + 1)} if one else None
    d1 = cost.draft.estimate(1)
    measured["draft_over_decode_pass"] = round(d1 / one, 4) if one and d1 else None
    print(f"verify (k+1 rows) / decode (1 row) pass: {measured['verify_over_decode_pass']}; draft / target pass: "
          f"{measured['draft_over_decode_pass']}")

    print()
    print("| temperature | batch | plain tok/s | speculative tok/s | speedup (wall) | pairs q1-q3 | speedup (per CPU-s) "
          "| acceptance | mean accepted length | k held (steps) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['temperature']} | {r['batch']} | {r['plain_tokens_per_s']} | {r['spec_tokens_per_s']} | "
              f"{r['speedup']:.2f}x | {r['speedup_q1']:.2f}-{r['speedup_q3']:.2f} | {r['speedup_cpu']:.2f}x | {r['acceptance_rate']} | "
              f"{r['mean_accepted_length']} | {r['k_steps']} |")
    result = {"config": {"target": (str(LARGE.relative_to(ROOT)) if args.target == "tiny-l"
                                    else f"tandem-tiny-l widened x{args.wide_factor} (training/widen.py)"),
                         "loadavg_start": load0, "loadavg_end": os.getloadavg(), "draft": str(SMALL.relative_to(ROOT)),
                         "draft_quantization": args.draft_quantization,
                         "k_max": args.k, "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
                         "repeats": args.repeats, "batched_repeats": args.batched_repeats, "threads": args.threads, "batch1_prompts": args.batch1_prompts,
                         "python": platform.python_version(), "cpu_simd": simd_level(),
                         "torch": torch.__version__, "machine": platform.machine()},
              "rows": rows, "fixed_k_batch1_greedy": sweep, "adaptive_cost_model": measured}
    write_results(Path(args.out), result, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
