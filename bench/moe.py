"""Mixture-of-experts decode on the CPU: a tiny MoE (8 experts, top-2, Mixtral-shaped) against a dense model with
the same active parameters (MLP width = 2 experts) and one with the same total (MLP width = 8 experts), batch-1
greedy decode through `LLM(...)`, one thread. All three run the C decoder stack (kernels/cpu_forward.py: the
MoE's router and its chosen experts' projections in the same call), the headline comparison; then all three on
the PyTorch forward (TANDEM_CPU_FORWARD=0), for reference. Each row names the forward it ran. Decode tok/s =
extra tokens / extra seconds between a short and a long run (the prefill cancels), per round, the rounds
alternating between the three models; each row reports the median. Prints a table, writes
bench/results/moe.json.

    .venv/bin/python bench/moe.py [--hidden 512] [--layers 4] [--tokens 96] [--rounds 5]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
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
from engines.families import FamilyTraits, MoETraits  # noqa: E402
from engines.model import Transformer  # noqa: E402
from engines.model_config import ModelConfig  # noqa: E402


def build(kind: str, hidden: int, layers: int, expert: int, experts: int, top_k: int) -> Transformer:
    heads = hidden // 64
    common = dict(vocab_size=2048, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=heads // 2,
                  head_dim=64, max_position_embeddings=1024)
    if kind == "moe":
        cfg = ModelConfig("MixtralForCausalLM", intermediate_size=expert, **common,
                          traits=FamilyTraits(family="mixtral", moe=MoETraits(experts, top_k, expert, True)))
    else:
        width = expert * (top_k if kind == "dense_active" else experts)
        cfg = ModelConfig("LlamaForCausalLM", intermediate_size=width, **common)
    torch.manual_seed(0)
    return Transformer(cfg).eval()


def decode_tok_s(llms: dict[str, LLM], short: int, long: int, rounds: int) -> dict[str, list[float]]:
    """Each model's decode tok/s in each round, the rounds alternating between the models (a neighbour's load on
    this shared machine then falls on all of them alike rather than on whichever ran during it)."""
    prompt = {"prompt_token_ids": list(range(3, 35))}
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (short, long)]
    for llm in llms.values():
        llm.generate(prompt, params[0])  # warm
    out: dict[str, list[float]] = {kind: [] for kind in llms}
    for _ in range(rounds):
        for kind, llm in llms.items():
            took = []
            for p in params:
                t0 = time.perf_counter()
                llm.generate(prompt, p)
                took.append(time.perf_counter() - t0)
            out[kind].append((long - short) / (took[1] - took[0]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--expert", type=int, default=1024, help="one expert's intermediate size")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "moe.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for c_forward in (True, False):
        os.environ["TANDEM_CPU_FORWARD"] = "1" if c_forward else "0"
        llms, sizes = {}, {}
        for kind in ("moe", "dense_active", "dense_total"):
            model = build(kind, args.hidden, args.layers, args.expert, args.experts, args.top_k)
            params = sum(p.numel() for p in model.parameters())
            per_layer = 3 * args.hidden * args.expert
            sizes[kind] = (params, params - (args.experts - args.top_k) * per_layer * args.layers
                           if kind == "moe" else params)
            llms[kind] = LLM(model, max_num_seqs=4, threads=1)
        for kind, per_round in decode_tok_s(llms, 16, 16 + args.tokens, args.rounds).items():
            forward = "C decoder stack" if llms[kind].engine.runner.cpu_forward is not None else "PyTorch"
            params, active = sizes[kind]
            tok_s = statistics.median(per_round)
            rows.append({"model": kind, "forward": forward, "params": params, "active_params": active,
                         "decode_tok_s": round(tok_s, 1), "rounds_tok_s": [round(x, 1) for x in per_round]})
            print(f"{kind:13s} {forward:16s} params {params / 1e6:6.1f}M active {active / 1e6:6.1f}M  "
                  f"decode {tok_s:7.1f} tok/s (median of {args.rounds}: "
                  f"{' '.join(f'{x:.1f}' for x in per_round)})", flush=True)
        del llms
    os.environ.pop("TANDEM_CPU_FORWARD", None)
    summary = {}
    for forward, key in (("C decoder stack", "c"), ("PyTorch", "torch")):
        tok = {r["model"]: r["decode_tok_s"] for r in rows if r["forward"] == forward}
        if len(tok) < 3:
            continue  # (the C kernels are not built here: every row ran the PyTorch forward)
        summary[f"{key}_moe_vs_dense_active"] = round(tok["moe"] / tok["dense_active"], 3)
        summary[f"{key}_moe_vs_dense_total"] = round(tok["moe"] / tok["dense_total"], 3)
        print(f"{forward}: MoE / dense-active {summary[f'{key}_moe_vs_dense_active']:.2f}x, MoE / dense-total "
              f"{summary[f'{key}_moe_vs_dense_total']:.2f}x")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"bench": "moe", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "commit": commit, "machine": {"platform": platform.platform(), "processor": platform.processor(),
                                            "cpus": os.cpu_count(), "threads": 1, "torch": torch.__version__},
              "config": vars(args), "rows": rows, "summary": summary,
              "command": "python bench/moe.py " + " ".join(argv or sys.argv[1:])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_results(Path(args.out), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
