"""Multi-step decoding (a multi-token `StepPlan`: 4 tokens per sequence in one C call, greedy or unseeded
temperature sampling) against one token per step (`MULTI_STEP_TOKENS = 1`), on one engine, alternated, one
thread: output tokens per thread CPU-second at batch 1 and 8, greedy and temperature 0.8, prompts from held-out
code. Prints a table, writes bench/results/multi_step.json.

    .venv/bin/python bench/multi_step.py [--model models/tandem-tiny-l] [--rounds 8] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import engines.step_plan as engine_mod  # noqa: E402
from bench.results_meta import write_results  # noqa: E402
from bench.speculative import prompts_from_heldout, run  # noqa: E402
from engines import LLM, SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tandem-tiny-l"))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "multi_step.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    llm = LLM(args.model, max_num_seqs=64)
    prompts = prompts_from_heldout(llm.tokenizer, 8, 64, seed=1)
    default = engine_mod.MULTI_STEP_TOKENS
    rows = []
    for temp in (0.0, 0.8):
        params = SamplingParams(temperature=temp, max_tokens=args.max_tokens, ignore_eos=True)
        for batch in (1, 8):
            def rate(tokens_per_step: int, batch: int = batch, params: SamplingParams = params) -> float:
                engine_mod.MULTI_STEP_TOKENS = tokens_per_step
                cpu = n = 0
                for i in range(0, len(prompts), batch):
                    _, dc, k, _ = run(llm, prompts[i:i + batch], params)
                    cpu += dc
                    n += k
                return n / cpu

            rate(default), rate(1)  # warm-up
            res = {default: [], 1: []}
            for r in range(args.rounds):
                for m in ((default, 1) if r % 2 == 0 else (1, default)):
                    res[m].append(rate(m))
            rows.append({"temperature": temp, "batch": batch, "single_step_tok_per_cpu_s": statistics.median(res[1]),
                         "multi_step_tok_per_cpu_s": statistics.median(res[default]),
                         "ratio": statistics.median(a / b for a, b in zip(res[default], res[1]))})
    engine_mod.MULTI_STEP_TOKENS = default
    print("| temperature | batch | one token per step, tok/CPU-s | multi-step, tok/CPU-s | ratio |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['temperature']} | {r['batch']} | {r['single_step_tok_per_cpu_s']:.0f} | "
              f"{r['multi_step_tok_per_cpu_s']:.0f} | {r['ratio']:.2f}x |")
    out = {"model": args.model, "rounds": args.rounds, "max_tokens": args.max_tokens, "rows": rows,
           "python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine()}
    write_results(Path(args.out), out, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
