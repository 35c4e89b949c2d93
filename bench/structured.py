"""Constrained decoding cost: output tokens/s with a JSON schema vs unconstrained sampling on the default pair
(tandem-tiny-s alone; tandem-tiny-l drafted by tandem-tiny-s), at batch 1 and 32, plus the time to compile a
schema the first time and from the cache, and the grammar work per token (xgrammar with and without the
control-byte mask, llguidance) along one fixed answer. Prints three tables, writes bench/results/structured.json.

    .venv/bin/python bench/structured.py [--threads 1] [--tokens 48]      # about two minutes
"""

from __future__ import annotations

import argparse
import json
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
from engines.structured import GrammarCompiler, StructuredOutput  # noqa: E402

SMALL, LARGE = ROOT / "models" / "tandem-tiny-s", ROOT / "models" / "tandem-tiny-l"
PROMPTS = ["def read_config(path):", "class Parser:", "import os\n", "def main():", "    return ",
           "# Describe the user\n", "data = {", "for item in items:"]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "id": {"type": "integer", "minimum": 0, "maximum": 100000},
    "role": {"enum": ["admin", "dev", "ops", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "id", "role", "tags", "address"], "additionalProperties": False}


def throughput(llm: LLM, batch: int, constrained: bool, tokens: int, rounds: int) -> dict:
    """Output tokens per second over `rounds` generate calls of `batch` prompts (temperature 0.8, seeded)."""
    so = StructuredOutput.json_schema(SCHEMA) if constrained else None
    rates, counts = [], []
    for r in range(rounds + 1):  # the first round warms up (and compiles the schema)
        params = [SamplingParams(temperature=0.8, seed=1000 * r + i, max_tokens=tokens, structured=so,
                                 ignore_eos=not constrained) for i in range(batch)]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        dt = time.perf_counter() - t0
        n = sum(len(c.token_ids) for o in outs for c in o.outputs)
        if r:
            rates.append(n / dt)
            counts.append(n / batch)
    return {"tokens_per_s": statistics.median(rates), "mean_output_tokens": statistics.mean(counts)}


def compile_times(llm: LLM, repeats: int = 20) -> dict:
    eng = llm.engine
    firsts, cached = [], []
    for i in range(repeats):
        comp = GrammarCompiler(eng.tokenizer, eng.config.vocab_size, eng.eos_token_ids)
        schema = dict(SCHEMA, title=f"s{i}")
        so = StructuredOutput.json_schema(schema)
        t0 = time.perf_counter()
        comp.compile(so)
        t1 = time.perf_counter()
        comp.compile(StructuredOutput.json_schema(schema))
        t2 = time.perf_counter()
        firsts.append((t1 - t0) * 1e3)
        cached.append((t2 - t1) * 1e3)
    return {"first_ms": statistics.median(firsts), "cached_ms": statistics.median(cached)}


# the same answer under the second backend: minProperties beside all-required properties is llguidance's
LLG_SCHEMA = dict(SCHEMA, minProperties=5)
ANSWER = {"name": "ada lovelace", "id": 1815, "role": "dev", "tags": ["math", "poet"],
          "address": {"city": "london", "zip": "12345"}}


def mask_costs(llm: LLM, reps: int = 30, rounds: int = 7) -> dict:
    """Grammar work per token along one fixed valid answer, in microseconds (median of `rounds`): the mask and
    the accept of a plain step, and the masks of a k = 4 speculative window, for the schema on xgrammar with
    and without the control-byte mask (Grammar.allowed), and on llguidance."""
    from engines.structured import Grammar

    eng = llm.engine
    comp = GrammarCompiler(eng.tokenizer, eng.config.vocab_size, eng.eos_token_ids)
    ids = eng.tokenizer.backend.encode(json.dumps(ANSWER, separators=(", ", ": ")), add_special_tokens=False).ids
    ids.append(min(eng.eos_token_ids))
    xgr_json, llg_json = (comp.compile(StructuredOutput.json_schema(s)) for s in (SCHEMA, LLG_SCHEMA))

    def fresh(kind):
        g = comp.matcher(llg_json if kind == "llguidance" else xgr_json)
        return Grammar(g.matcher, g.vocab_size) if kind == "xgrammar, no control-byte mask" else g

    def once(kind) -> tuple[float, float]:
        t0 = time.perf_counter()
        for _ in range(reps):
            g = fresh(kind)
            for t in ids:
                g.next_mask()
                g.accept(t)
        t1 = time.perf_counter()
        for _ in range(reps):
            g = fresh(kind)
            for j in range(len(ids) - 4):
                g.window_masks(ids[j:j + 4])
                g.accept(ids[j])
        t2 = time.perf_counter()
        return (t1 - t0) / (reps * len(ids)) * 1e6, (t2 - t1) / (reps * (len(ids) - 4)) * 1e6

    kinds = ["xgrammar, no control-byte mask", "xgrammar", "llguidance"]
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for _ in range(rounds):  # interleaved, so that load on the machine falls on every kind alike
        for k in kinds:
            runs[k].append(once(k))
    return {k: {"step_us": statistics.median(r[0] for r in v), "window_k4_us": statistics.median(r[1] for r in v)}
            for k, v in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=48, help="max_tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "structured.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engines = {"tandem-small": LLM(SMALL, name="s"), "tandem-large+draft": LLM(LARGE, name="l", draft_model=SMALL)}
    rows = []
    for name, llm in engines.items():
        for batch in (1, 32):
            row = {"engine": name, "batch": batch}
            for constrained in (False, True):
                r = throughput(llm, batch, constrained, args.tokens, args.rounds)
                key = "constrained" if constrained else "unconstrained"
                row[f"{key}_tokens_per_s"] = r["tokens_per_s"]
                row[f"{key}_mean_tokens"] = r["mean_output_tokens"]
            row["ratio"] = row["constrained_tokens_per_s"] / row["unconstrained_tokens_per_s"]
            rows.append(row)
    compile_ = compile_times(engines["tandem-small"])
    masks = mask_costs(engines["tandem-small"])

    print(f"{'engine':<20} {'batch':>5} {'unconstrained tok/s':>20} {'constrained tok/s':>18} {'ratio':>6} "
          f"{'tokens/req (u/c)':>17}")
    for r in rows:
        print(f"{r['engine']:<20} {r['batch']:>5} {r['unconstrained_tokens_per_s']:>20.0f} "
              f"{r['constrained_tokens_per_s']:>18.0f} {r['ratio']:>6.2f} "
              f"{r['unconstrained_mean_tokens']:>8.1f}/{r['constrained_mean_tokens']:<8.1f}")
    print(f"\nschema compile (xgrammar, {len(json.dumps(SCHEMA))}-byte schema): first {compile_['first_ms']:.2f} ms, "
          f"cached {compile_['cached_ms'] * 1e3:.1f} us")
    print(f"\n{'grammar work per token':<32} {'step (mask + accept) us':>24} {'k=4 window us':>14}")
    for k, v in masks.items():
        print(f"{k:<32} {v['step_us']:>24.1f} {v['window_k4_us']:>14.1f}")
    result = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
              "torch": torch.__version__, "max_tokens": args.tokens, "rounds": args.rounds, "schema": SCHEMA,
              "throughput": rows, "compile": compile_, "mask_costs": masks}
    write_results(Path(args.out), result, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
