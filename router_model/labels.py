"""Task-success router labels for the default tiny models: line completion on modules the models never saw.

A prompt is a window of a module of the corpus's `heldout` / `validation` splits that ends at a line boundary
inside the module (the window's last token holds the newline, plus whatever indentation the tokenizer merged
into it); the reference is the rest of that line. Each model completes the line greedily through the engine
(`engines.LLM`, many prompts per `generate` call, `stop=["\\n"]`, `max_tokens` bounded by the line's length), and
the completion is scored against the reference as CodeXGLUE's line-level task does: exact match and edit
similarity on whitespace-normalised text (`router_model.scoring`). `small_score` / `large_score` hold the chosen
metric (`--score`), both metrics stay in the row, next to both answers and the statistics of the small answer's
token logprobs (the cascade's escalation scorer trains on them). Train/test are split by module.

    tandem router label --out-dir models/router/labels --threads 1
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from router_model.scoring import ENTROPY_TOP_K, answer_stats, edit_similarity, exact_match


@dataclass
class LinePrompt:
    module: str
    start: int  # token offset of the window in the module
    prompt_ids: list[int]
    reference: str  # the rest of the line the window stops in
    line_tokens: int  # tokens of the module up to and including the one that ends the line


def module_side(module: str, test_fraction: float) -> str:
    """'train' or 'test' by a stable hash of the module name (the same on every machine)."""
    bucket = int.from_bytes(hashlib.sha256(f"router:{module}".encode()).digest()[:8], "big") % 1000
    return "test" if bucket < test_fraction * 1000 else "train"


def token_pieces(tok) -> list[str]:
    """The text of every token id on its own (newline detection only; partial UTF-8 decodes are fine)."""
    return [tok.decode([i], skip_special_tokens=False) for i in range(tok.vocab_size)]


def line_prompts(modules: list[tuple[str, list[int]]], pieces: list[str], decode, per_module_cap: int,
                 min_prompt: int, max_prompt: int, max_line_tokens: int, seed: int) -> list[LinePrompt]:
    """Every line boundary at least `min_prompt` tokens into a module whose next line is non-blank and ends
    within `max_line_tokens` tokens (at most `per_module_cap` per module, chosen at random); each window has a
    log-uniform length in [min_prompt, max_prompt] tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for name, ids in modules:
        has_nl = np.array(["\n" in pieces[t] for t in ids], dtype=bool)
        nl_at = np.flatnonzero(has_nl)
        candidates = []
        for k, p_minus_1 in enumerate(nl_at[:-1]):
            p = int(p_minus_1) + 1
            q = int(nl_at[k + 1])  # the token that ends the target line
            if p < min_prompt or q - p + 1 > max_line_tokens:
                continue
            candidates.append((p, q))
        if len(candidates) > per_module_cap:
            keep = np.sort(rng.choice(len(candidates), size=per_module_cap, replace=False))
            candidates = [candidates[i] for i in keep]
        for p, q in candidates:
            reference = decode(ids[p:q + 1]).split("\n")[0]
            if not reference.strip():
                continue
            length = int(round(math.exp(rng.uniform(math.log(min_prompt), math.log(max_prompt)))))
            start = max(0, p - length)
            out.append(LinePrompt(name, start, ids[start:p], reference, q - p + 1))
    return out


def complete_lines(model_dir: Path, prompts: list[list[int]], max_tokens: list[int], want_stats: bool,
                   batch: int = 512, log=print, **engine_options) -> tuple[list[str], list[dict] | None]:
    """Greedy completions (stopping at a newline) of token-id prompts with the offline engine, `batch`
    prompts per `generate` call; with `want_stats` also `answer_stats` of each (top logprobs on)."""
    from engines import LLM, SamplingParams

    options = {"max_num_seqs": 128, "max_num_batched_tokens": 4096, "memory_bytes": 512 << 20} | engine_options
    llm = LLM(model=str(model_dir), **options)
    texts: list[str] = []
    stats: list[dict] = []
    t0 = time.perf_counter()
    for b in range(0, len(prompts), batch):
        params = [SamplingParams(temperature=0.0, max_tokens=m, stop=["\n"],
                                 logprobs=ENTROPY_TOP_K if want_stats else None)
                  for m in max_tokens[b:b + batch]]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[b:b + batch]], params)
        for o in outs:
            c = o.outputs[0]
            texts.append(c.text)
            if want_stats:
                pieces = [llm.tokenizer.decode([t], skip_special_tokens=False) for t in c.token_ids]
                stats.append(answer_stats(c.token_ids, c.logprobs, pieces))
        done = min(b + batch, len(prompts))
        log(f"  {model_dir.name}: {done}/{len(prompts)} prompts, {done / (time.perf_counter() - t0):.1f}/s")
    return texts, (stats if want_stats else None)


def open_jsonl(path: Path, mode: str):
    """A JSONL file, gzip-compressed when the name ends in .gz."""
    if path.suffix == ".gz":
        return gzip.open(path, mode + "t", encoding="utf-8")
    return path.open(mode, encoding="utf-8")


def build(small_dir: Path, large_dir: Path, out_dir: Path, *, per_module_cap: int = 100000, min_prompt: int = 32,
          max_prompt: int = 256, max_line_tokens: int = 40, slack_tokens: int = 4, test_fraction: float = 0.5,
          splits: tuple[str, ...] = ("heldout", "validation"), score: str = "exact", limit: int = 0,
          max_modules: int = 0,
          seed: int = 0, batch: int = 512, suffix: str = ".jsonl.gz", log=print, **engine_options) -> dict:
    """Write train/test label files (split by module) and summary.json; returns the summary."""
    from engines.tokenizer import Tokenizer
    from training.corpus import load_corpus_split

    t0 = time.perf_counter()
    if score not in ("exact", "edit"):
        raise ValueError(f"score must be 'exact' or 'edit', got {score!r}")
    if (small_dir / "tokenizer.json").read_bytes() != (large_dir / "tokenizer.json").read_bytes():
        raise ValueError(f"{small_dir} and {large_dir} use different tokenizers: one prompt cannot serve both")
    if "train" in splits:
        raise ValueError("the models trained on the 'train' split: label prompts must come from unseen modules")
    tok = Tokenizer.from_pretrained(small_dir)
    texts = [(name, text) for split in splits for name, text in load_corpus_split(split)]
    if max_modules:  # a quick sample: the smallest modules
        texts = sorted(texts, key=lambda m: len(m[1]))[:max_modules]
    modules = [(name, tok.encode(text)) for name, text in texts]
    prompts = line_prompts(modules, token_pieces(tok), tok.decode, per_module_cap, min_prompt, max_prompt,
                           max_line_tokens, seed)
    if limit and len(prompts) > limit:  # evenly spread over the modules, for a quick sample
        keep = np.linspace(0, len(prompts) - 1, limit).round().astype(int)
        prompts = [prompts[i] for i in keep]
    log(f"{len(prompts)} line prompts from {len({p.module for p in prompts})} modules of {'+'.join(splits)}")
    ids = [p.prompt_ids for p in prompts]
    budget = [p.line_tokens + slack_tokens for p in prompts]
    answers = {}
    seconds = {}
    for role, folder in (("small", small_dir), ("large", large_dir)):
        t = time.perf_counter()
        answers[role] = complete_lines(folder, ids, budget, want_stats=role == "small", batch=batch, log=log,
                                       **engine_options)
        seconds[role] = round(time.perf_counter() - t, 1)

    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {"train": 0, "test": 0}
    files = {side: open_jsonl(out_dir / f"{side}{suffix}", "w") for side in counts}
    metrics = {f"{r}_{m}": [] for r in ("small", "large") for m in ("exact", "edit")}
    try:
        for i, p in enumerate(prompts):
            row = {"prompt": tok.decode(p.prompt_ids, skip_special_tokens=False), "reference": p.reference}
            for role in ("small", "large"):
                text = answers[role][0][i]
                row[f"{role}_answer"] = text
                row[f"{role}_exact"] = exact_match(text, p.reference)
                row[f"{role}_edit"] = round(edit_similarity(text, p.reference), 4)
                metrics[f"{role}_exact"].append(row[f"{role}_exact"])
                metrics[f"{role}_edit"].append(row[f"{role}_edit"])
            row["small_score"], row["large_score"] = row[f"small_{score}"], row[f"large_{score}"]
            row["small_answer_stats"] = {k: round(v, 5) for k, v in answers["small"][1][i].items()}
            row |= {"group": p.module, "prompt_tokens": len(p.prompt_ids), "start_token": p.start,
                    "max_tokens": budget[i]}
            side = module_side(p.module, test_fraction)
            files[side].write(json.dumps(row, ensure_ascii=False) + "\n")
            counts[side] += 1
    finally:
        for f in files.values():
            f.close()
    se, le = np.array(metrics["small_exact"]), np.array(metrics["large_exact"])
    summary = {
        "task": "line completion (greedy, stop at newline), CodeXGLUE-style whitespace-normalised scoring",
        "small": str(small_dir), "large": str(large_dir), "splits": list(splits), "prompts": len(prompts),
        "train": counts["train"], "test": counts["test"], "score": score, "test_fraction": test_fraction,
        "prompt_tokens": [min_prompt, max_prompt], "max_line_tokens": max_line_tokens,
        "slack_tokens": slack_tokens, "per_module_cap": per_module_cap, "limit": limit, "seed": seed,
        "max_modules": max_modules,
        **{f"mean_{k}": float(np.mean(v)) for k, v in metrics.items()},
        "large_only_right": float(np.mean((le == 1) & (se == 0))),
        "small_only_right": float(np.mean((se == 1) & (le == 0))),
        "generate_seconds": seconds, "seconds": round(time.perf_counter() - t0, 1),
        "files": {side: f"{side}{suffix}" for side in counts},
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"wrote {counts['train']} train / {counts['test']} test rows to {out_dir} in {summary['seconds']}s: "
        f"EM small {summary['mean_small_exact']:.3f} large {summary['mean_large_exact']:.3f}")
    return summary


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tandem router label", description=__doc__.splitlines()[0],
                                epilog="With --data, labels your own prompts instead: see router_model/user_labels.py")
    p.add_argument("--small", default="models/tandem-tiny-s")
    p.add_argument("--large", default="models/tandem-tiny-l")
    p.add_argument("--out-dir", default="models/router/labels", help="writes train/test label files + summary.json")
    p.add_argument("--splits", nargs="+", default=["heldout", "validation"], choices=("heldout", "validation"))
    p.add_argument("--score", choices=("exact", "edit"), default="exact",
                   help="metric written as small_score/large_score (both are kept in every row)")
    p.add_argument("--per-module-cap", type=int, default=100000, help="line prompts per module at most")
    p.add_argument("--limit", type=int, default=0, help="label only this many prompts, evenly spread (0: all)")
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--max-line-tokens", type=int, default=40)
    p.add_argument("--test-fraction", type=float, default=0.5, help="share of modules held out as the test set")
    p.add_argument("--batch", type=int, default=512, help="prompts per generate call")
    p.add_argument("--dtype", default="auto", help="engine dtype (auto: the checkpoint's, as the gateway serves)")
    p.add_argument("--suffix", default=".jsonl.gz", choices=(".jsonl.gz", ".jsonl"))
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        build(Path(args.small), Path(args.large), Path(args.out_dir), per_module_cap=args.per_module_cap,
              min_prompt=args.min_prompt, max_prompt=args.max_prompt, max_line_tokens=args.max_line_tokens,
              test_fraction=args.test_fraction, splits=tuple(args.splits), score=args.score, limit=args.limit,
              seed=args.seed, batch=args.batch, suffix=args.suffix, dtype=args.dtype)
    except (OSError, ValueError) as e:
        print(f"tandem router label: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
