"""The C decoder stack reading bf16 copies of bf16-exact float32 weights (the default) against reading the float32
weights (`TANDEM_CPU_BF16_WEIGHTS=0`): the same model in one process, both engines alternated, one thread,
medians of thread CPU time. Greedy decode ms per token at batch 1 and 8 (the outputs must be equal), and one
forward of 1 and 5 query rows (a decode, a verify window of 4 drafts) warm and right after 16 MB of other
memory traffic (what another model's pass leaves, as a speculative draft's). Prints a table, writes
bench/results/cpu_bf16.json.

    .venv/bin/python bench/cpu_bf16.py [--model models/tandem-tiny-l] [--rounds 7] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402
from engines import LLM, SamplingParams  # noqa: E402
from kernels import cpu_kernels  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tandem-tiny-l"))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_bf16.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    llms = {}
    for name, env in (("f32", "0"), ("bf16", "1")):
        os.environ["TANDEM_CPU_BF16_WEIGHTS"] = env
        llms[name] = LLM(args.model, max_model_len=512)
    os.environ.pop("TANDEM_CPU_BF16_WEIGHTS")
    if llms["bf16"].engine.runner.cpu_forward._head[1] is None:
        raise SystemExit("no bf16 copies: the checkpoint's weights are not bf16-exact (or there is no C forward)")
    rows = {}
    for b in (1, 8):
        prompts = [f"def f{i}(x, y):\n    return" for i in range(b)]
        sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        outs = {n: llm.generate(prompts, sp) for n, llm in llms.items()}  # warm-up, and the same tokens
        if [o.outputs[0].token_ids for o in outs["f32"]] != [o.outputs[0].token_ids for o in outs["bf16"]]:
            raise SystemExit("the outputs differ")
        ts = {n: [] for n in llms}
        for r in range(args.rounds):
            for n in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
                t = time.thread_time()
                llms[n].generate(prompts, sp)
                ts[n].append((time.thread_time() - t) / args.max_tokens * 1e3)
        rows[f"decode, batch {b}, ms per token step"] = {n: statistics.median(v) for n, v in ts.items()}
    sweep = torch.ones(4 << 20)  # 16 MB
    for q in (1, 5):
        ctx = 60
        step = (torch.randint(4, 4000, (q,)), torch.arange(ctx - q, ctx, dtype=torch.long),
                torch.arange(16, dtype=torch.long).view(1, 16), torch.tensor([[0], [q], [ctx], [0]]), ctx)
        for cold in (False, True):
            ts = {n: [] for n in llms}
            for r in range(args.rounds * 60):
                for n in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
                    fwd = llms[n].engine.runner.cpu_forward
                    if cold:
                        sweep.add_(1.0)
                    else:
                        fwd.forward(*step)
                    t = time.thread_time()
                    fwd.forward(*step)
                    ts[n].append((time.thread_time() - t) * 1e3)
            rows[f"{q}-row forward, {'after 16 MB of other traffic' if cold else 'warm'}, ms"] = {
                n: statistics.median(v) for n, v in ts.items()}
    print("| what | float32 reads | bf16 copies | ratio |")
    print("|---|---|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v['f32']:.3f} | {v['bf16']:.3f} | {v['bf16'] / v['f32']:.2f} |")
    out = {"model": args.model, "rounds": args.rounds, "rows": rows, "calibration": cpu_kernels.calibration(),
           "python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine()}
    write_results(Path(args.out), out, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
