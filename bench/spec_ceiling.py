"""The ceiling of batch-1 speculative decoding on this machine with the default tiny pair: the speedup an
implementation would reach if everything but the two models' forward passes were free.

For each temperature (0 and 0.8) and each pinned k (1..k_max) it serves the same held-out prompts as
bench/speculative.py one after another, plain and speculative alternately, and measures inside those runs:
- P, the target's plain decode pass (forward + logits of one token), median;
- V(k), the target's verify pass over k + 1 tokens, median;
- D, one draft pass of one token (the batch-1 lean forward; the draft's sampling not included), median;
- a_j, the acceptance of draft position j given position j - 1 was accepted (k pinned at k_max);
- the real speedup at that k (tokens/s, speculative over plain).
Then the ceiling at k is E(k) * P / (V(k) + k * D), E(k) = 1 + sum_i prod_{j<=i} a_j the expected tokens per
verify pass. No scheduling, sampling, rejection or bookkeeping cost is counted, so a real step can only be
slower: the ceiling bounds what any implementation of this pair gets on this CPU. Last, one draft token's
matmuls in float32 against the forms that could shrink D (bfloat16, float16, int8 weights, MKL's prepacked
linear). Prints a table, writes bench/results/spec_ceiling.json.

    .venv/bin/python bench/spec_ceiling.py [--repeats 2] [--k 4] [--batch1-prompts 6] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.speculative import LARGE, SMALL, prompts_from_heldout, run_batch  # noqa: E402
from engines import LLM, SamplingParams  # noqa: E402


class PassTimer:
    """Wall seconds of a model's forward + logits passes at batch 1, keyed by the number of tokens."""

    def __init__(self, model: torch.nn.Module):
        self.seconds: dict[int, list[float]] = defaultdict(list)
        self._t0 = 0.0
        self._n = 0
        forward, logits = model.forward, model.compute_logits

        def timed_forward(input_ids, *args, **kwargs):
            self._t0, self._n = time.perf_counter(), input_ids.shape[0]
            return forward(input_ids, *args, **kwargs)

        def timed_logits(hidden):
            out = logits(hidden)
            if hidden.shape[0] == self._n:  # a decode or verify pass: every token samples (not a prefill)
                self.seconds[self._n].append(time.perf_counter() - self._t0)
            return out

        model.forward, model.compute_logits = timed_forward, timed_logits

    def median(self, n: int) -> float:
        return statistics.median(self.seconds[n])


class DraftTimer:
    """Wall seconds of the drafter's batch-1 one-token passes (the lean forward, no sampling)."""

    def __init__(self, lean: object):
        self.seconds: list[float] = []
        dense = lean._dense

        def timed(states, num_new):
            t0 = time.perf_counter()
            out = dense(states, num_new)
            if list(num_new) == [1]:
                self.seconds.append(time.perf_counter() - t0)
            return out

        lean._dense = timed


def expected_tokens(conditional: list[float], k: int) -> float:
    """Tokens per verify pass with k drafts: 1 + sum over i <= k of P(the first i drafts are all accepted)."""
    total, run = 1.0, 1.0
    for a in conditional[:k]:
        run *= a
        total += run
    return total


def draft_matmul_variants(model: torch.nn.Module, repeats: int = 200) -> dict[str, float]:
    """Microseconds for one draft token's matmuls (every Linear of the draft, the logits head included, one
    row each, cycling through all of them as a forward does) in float32 and the lower-precision or prepacked
    forms that could make D smaller; median of `repeats`."""
    weights = [m.weight.detach() for m in model.modules() if type(m) is torch.nn.Linear]
    ws = [w.float().t().contiguous() for w in weights]  # [in, out]: x @ w, the lean forward's layout
    xs = [torch.randn(1, w.shape[0]) for w in ws]

    def median_us(fn) -> float:
        for _ in range(20):
            fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    out = {"float32 mm": median_us(lambda: [torch.mm(x, w) for x, w in zip(xs, ws)])}
    for dtype in (torch.bfloat16, torch.float16):
        wl, xl = [w.to(dtype) for w in ws], [x.to(dtype) for x in xs]
        out[f"{str(dtype)[6:]} mm"] = median_us(lambda xl=xl, wl=wl: [torch.mm(x, w) for x, w in zip(xl, wl)])
    if hasattr(torch.ops.aten, "_weight_int8pack_mm") and all(w.shape[0] % 16 == 0 for w in ws):
        scales = [w.abs().amax(0).clamp(min=1e-8) / 127 for w in ws]  # per output channel
        packed = [(w / sc).round().clamp(-127, 127).to(torch.int8).t().contiguous() for w, sc in zip(ws, scales)]
        xb, sb = [x.bfloat16() for x in xs], [sc.bfloat16() for sc in scales]
        out["int8 weights, bfloat16 activations"] = median_us(
            lambda: [torch.ops.aten._weight_int8pack_mm(x, w, sc) for x, w, sc in zip(xb, packed, sb)])
    if torch._C.has_mkl and hasattr(torch.ops.mkl, "_mkl_linear"):
        wo = [w.t().contiguous() for w in ws]  # [out, in]
        pk = [torch.ops.mkl._mkl_reorder_linear_weight(w, 1) for w in wo]
        out["MKL prepacked linear"] = median_us(
            lambda: [torch.ops.mkl._mkl_linear(x, p, w, None, 1) for x, p, w in zip(xs, pk, wo)])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4, help="k_max: k is pinned at 1..k")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--batch1-prompts", type=int, default=6)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "spec_ceiling.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    plain = LLM(LARGE, max_num_seqs=64)
    spec = LLM(LARGE, draft_model=SMALL, num_speculative_tokens=args.k, max_num_seqs=64)
    speculator = spec.engine.speculator
    if speculator.drafter is None or speculator.drafter.lean is None:
        raise SystemExit("the drafter has no batch-1 lean forward here (a quantised or unusual draft model)")
    tok = plain.tokenizer
    warm = prompts_from_heldout(tok, 2, args.prompt_tokens, seed=99)
    for llm in (plain, spec):
        llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(temperature=0, max_tokens=64))
    plain_passes = PassTimer(plain.engine.runner.model)
    verify_passes = PassTimer(spec.engine.runner.model)
    draft_passes = DraftTimer(speculator.drafter.lean)
    prompts = prompts_from_heldout(tok, args.batch1_prompts, args.prompt_tokens, seed=1)  # bench/speculative's

    results = []
    for temp in args.temperatures:
        params = SamplingParams(temperature=temp, max_tokens=args.max_tokens, ignore_eos=True, seed=7)
        plain_passes.seconds.clear()
        per_k = []
        conditional: list[float] = []
        for k in range(args.k, 0, -1):  # k_max first: its windows give the acceptance of every position
            speculator.adaptive.fixed = k
            verify_passes.seconds.clear()
            draft_passes.seconds.clear()
            before = speculator.stats()
            ratios = []
            for _ in range(args.repeats):  # alternate so both see the same background load
                dt_p, _, n_p, _ = run_batch(plain, prompts, params, 1)
                dt_s, _, n_s, _ = run_batch(spec, prompts, params, 1)
                ratios.append((n_s / dt_s) / (n_p / dt_p))
            after = speculator.stats()
            if k == args.k:
                was = before["spec_accepted_per_position"]
                was = was + [0] * (len(after["spec_accepted_per_position"]) - len(was))
                acc = [a - b for a, b in zip(after["spec_accepted_per_position"], was)]
                windows = after["spec_num_drafts"] - before["spec_num_drafts"]
                reached = [windows] + acc[:-1]
                conditional = [a / r if r else 0.0 for a, r in zip(acc, reached)][:args.k]
            per_k.append({"k": k, "verify_pass_s": verify_passes.median(k + 1),
                          "draft_pass_s": statistics.median(draft_passes.seconds),
                          "real_speedup": statistics.median(ratios)})
        speculator.adaptive.fixed = None
        p = plain_passes.median(1)
        rows = []
        for r in sorted(per_k, key=lambda r: r["k"]):
            k, v, d = r["k"], r["verify_pass_s"], r["draft_pass_s"]
            e = expected_tokens(conditional, k)
            rows.append({"k": k, "expected_tokens": round(e, 3), "verify_over_plain": round(v / p, 3),
                         "draft_over_plain": round(d / p, 3), "ceiling": round(e * p / (v + k * d), 3),
                         "real_speedup": round(r["real_speedup"], 3), "verify_pass_ms": round(v * 1e3, 3),
                         "draft_pass_ms": round(d * 1e3, 3)})
        results.append({"temperature": temp, "plain_pass_ms": round(p * 1e3, 3),
                        "conditional_acceptance": [round(a, 3) for a in conditional], "rows": rows,
                        "best_ceiling": max(r["ceiling"] for r in rows)})
        print(f"temperature {temp}: plain pass {p * 1e3:.3f} ms, acceptance of position j given j - 1: "
              f"{[round(a, 3) for a in conditional]}", flush=True)
        for r in rows:
            print(f"  k={r['k']}: E={r['expected_tokens']:.2f} tokens/pass, verify {r['verify_over_plain']:.2f}x "
                  f"a plain pass, draft {r['draft_over_plain']:.3f}x per token -> ceiling {r['ceiling']:.2f}x, "
                  f"real {r['real_speedup']:.2f}x", flush=True)

    variants = draft_matmul_variants(spec.engine.speculator.drafter.model)
    print("\none draft token's matmuls, microseconds (median): "
          + ", ".join(f"{k} {v:.0f}" for k, v in variants.items()))
    print()
    print("| temperature | k | tokens per verify pass | verify pass / plain pass | draft pass / plain pass | "
          "ceiling | real (pinned k) |")
    print("|---|---|---|---|---|---|---|")
    for res in results:
        for r in res["rows"]:
            print(f"| {res['temperature']} | {r['k']} | {r['expected_tokens']:.2f} | {r['verify_over_plain']:.2f} | "
                  f"{r['draft_over_plain']:.3f} | {r['ceiling']:.2f}x | {r['real_speedup']:.2f}x |")
    out = {"config": {"target": str(LARGE.relative_to(ROOT)), "draft": str(SMALL.relative_to(ROOT)),
                      "k_max": args.k, "repeats": args.repeats, "max_tokens": args.max_tokens,
                      "prompt_tokens": args.prompt_tokens, "batch1_prompts": args.batch1_prompts,
                      "python": platform.python_version(), "torch": torch.__version__,
                      "machine": platform.machine()},
           "temperatures": results, "draft_matmuls_us": {k: round(v, 1) for k, v in variants.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
