"""CPU weight layout: `F.linear` with row-major ([out, in] contiguous, as checkpoints store them) vs column-major
([in, out] contiguous seen as [out, in], what `engines.model.cpu_weight_layout` gives every float32 Linear on
the CPU) weights: per-op times at the default tiny models' shapes, then the large tiny model's plain decode
throughput with each layout. Prints two tables, writes bench/results/cpu_layout.json.

    .venv/bin/python bench/cpu_layout.py [--threads 1]      # about a minute
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402
from bench.speculative import LARGE, prompts_from_heldout, run  # noqa: E402
from engines import LLM, SamplingParams  # noqa: E402

# (rows, in, out): tandem-tiny-l's fused-size projections and logits head, tandem-tiny-s's q/k/v
SHAPES = [(m, k, n) for m in (1, 5, 32) for (k, n) in ((256, 768), (256, 1408), (704, 256), (256, 4096))] + [
    (1, 128, 384), (1, 128, 4096)]


def op_time(f, n: int) -> float:
    for _ in range(max(10, n // 20)):
        f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e6


def row_major(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for m in model.modules():
            if type(m) is torch.nn.Linear and not m.weight.is_contiguous():
                m.weight.data = m.weight.data.contiguous()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_layout.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ops = []
    with torch.inference_mode():
        for m, k, n in SHAPES:
            x, w = torch.randn(m, k), torch.randn(n, k)
            wc = w.t().contiguous().t()
            reps = 2000 if m * n < 50_000 else 300
            a = op_time(lambda x=x, w=w: F.linear(x, w), reps)
            b = op_time(lambda x=x, w=wc: F.linear(x, w), reps)
            ops.append({"rows": m, "in": k, "out": n, "row_major_us": round(a, 1), "col_major_us": round(b, 1),
                        "speedup": round(a / b, 2)})
    print("| rows x in -> out | row-major us | column-major us | speedup |\n|---|---|---|---|")
    for o in ops:
        print(f"| {o['rows']} x {o['in']} -> {o['out']} | {o['row_major_us']} | {o['col_major_us']} | "
              f"{o['speedup']:.2f}x |")

    col = LLM(LARGE, max_num_seqs=64)
    row = LLM(LARGE, max_num_seqs=64)
    row_major(row.engine.model)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    decode = []
    for batch in (1, 8, 32):
        prompts = prompts_from_heldout(col.tokenizer, batch, 64, seed=batch)
        rates = {"col": [], "row": []}
        run(col, prompts, params)
        run(row, prompts, params)
        for _ in range(args.repeats):  # alternating, so both see the same background load
            for name, llm in (("col", col), ("row", row)):
                dt, _, n, _ = run(llm, prompts, params)
                rates[name].append(n / dt)
        c, r = statistics.median(rates["col"]), statistics.median(rates["row"])
        decode.append({"batch": batch, "row_major_tok_s": round(r, 1), "col_major_tok_s": round(c, 1),
                       "speedup": round(c / r, 3)})
    print("\n| batch | row-major tok/s | column-major tok/s | speedup |\n|---|---|---|---|")
    for d in decode:
        print(f"| {d['batch']} | {d['row_major_tok_s']} | {d['col_major_tok_s']} | {d['speedup']:.2f}x |")
    out = {"ops": ops, "decode_tandem_tiny_l": decode, "threads": args.threads,
           "machine": f"{platform.machine()}, torch {torch.__version__}"}
    write_results(Path(args.out), out, indent=2)
    print(f"wrote {Path(args.out).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
