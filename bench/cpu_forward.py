"""The CPU engine's decode speed in process, with the one-call C forward (kernels/cpu_forward.py) and with the
PyTorch forward it replaces, on the same engine, alternated: greedy, `--max-tokens` new tokens per request,
batches of 1, 8 and 32 requests (different prompts), float32, weight-only int8, w8a8 and int4 (g64), one thread. Reports the
best of `--repeats` wall times as ms per decode step and output tok/s, and the ratio. Prints a table and writes
bench/results/cpu_forward.json.

    .venv/bin/python bench/cpu_forward.py [--model models/tandem-tiny-l] [--batches 1 8 32] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402
from engines import LLM, SamplingParams  # noqa: E402


def timed(llm: LLM, prompts: list[str], sp: SamplingParams, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        llm.generate(prompts, sp)
        best = min(best, time.perf_counter() - t)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tandem-tiny-l"))
    ap.add_argument("--quant", nargs="+", default=["none", "int8", "w8a8", "int4"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_forward.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for quant in args.quant:
        llm = LLM(args.model, max_model_len=512, quantization=quant)
        runner = llm.engine.runner
        fast = runner.cpu_forward
        if fast is None:
            raise SystemExit(f"the C forward does not cover {args.model} ({quant})")
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        for b in args.batches:
            prompts = [f"def f{i}(x, y):\n    return" for i in range(b)]
            llm.generate(prompts, sp)  # warm
            outs: dict[str, list[list[int]]] = {}
            times = {}
            for name, fwd in (("c", fast), ("torch", None), ("c", fast), ("torch", None)):  # alternated
                runner.cpu_forward = fwd
                t = timed(llm, prompts, sp, args.repeats)
                times[name] = min(times.get(name, t), t)
                out = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], sp)]
                assert outs.setdefault(name, out) == out, f"{name}: greedy outputs differ between runs"
            runner.cpu_forward = fast
            # float32 and int8: the two forwards agree token for token; w8a8 / int4 round every activation to
            # 8 bits, so a float-rounding difference between the paths can flip one rounding and, many tokens
            # later, a near-tie argmax: reported as the share of tokens before the first difference
            a, b2 = outs["c"], outs["torch"]
            prefix = sum(next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
                         for p, q in zip(a, b2)) / sum(len(p) for p in a)
            if quant in ("none", "int8"):
                assert a == b2, "greedy outputs differ between the C and torch forwards"
            steps = args.max_tokens
            row = {"quant": quant, "batch": b,
                   "c_ms_per_step": 1e3 * times["c"] / steps, "torch_ms_per_step": 1e3 * times["torch"] / steps,
                   "c_tok_s": b * steps / times["c"], "torch_tok_s": b * steps / times["torch"],
                   "speedup": times["torch"] / times["c"], "same_prefix_fraction": round(prefix, 3)}
            rows.append(row)
            print(row, flush=True)
    print("\n| weights | batch | C forward ms/step | torch forward ms/step | C tok/s | torch tok/s | speedup | "
          "greedy tokens equal before the first difference |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {'f32' if r['quant'] == 'none' else r['quant']} | {r['batch']} | {r['c_ms_per_step']:.2f} | "
              f"{r['torch_ms_per_step']:.2f} | {r['c_tok_s']:.0f} | {r['torch_tok_s']:.0f} | {r['speedup']:.2f}x | "
              f"{100 * r['same_prefix_fraction']:.0f}% |")
    result = {"model": args.model, "threads": args.threads, "max_tokens": args.max_tokens, "rows": rows,
              "load_average": os.getloadavg(), "machine": platform.processor() or platform.machine()}
    write_results(Path(args.out), result, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
