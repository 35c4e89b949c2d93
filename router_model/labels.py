"""Labelled router data for the default tiny models, built from corpus modules the models never trained on.

Each prompt is a chunk (a random 16-208 token window) of a module the models never trained on (the corpus's
`heldout` and `validation` splits); its continuation is the next 48 tokens. A model's quality on the prompt is
the teacher-forced mean log-probability of that true continuation (= -loss), so PGR compares how much of the large model's log-likelihood gain a router recovers. The small
model's mean prompt log-probability comes free from the same pass and is saved as the `small_prompt_logprob`
extra. Train/test are split by module, so no module's text appears on both sides.

    tandem router label --small models/tandem-tiny-s --large models/tandem-tiny-l --out-dir models/router/labels
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Chunk:
    module: str
    start: int  # token offset of the prompt in the module
    prompt_ids: list[int]
    continuation_ids: list[int]


def module_side(module: str, test_fraction: float) -> str:
    """'train' or 'test' by a stable hash of the module name (the same on every machine)."""
    bucket = int.from_bytes(hashlib.sha256(f"router:{module}".encode()).digest()[:8], "big") % 1000
    return "test" if bucket < test_fraction * 1000 else "train"


def make_chunks(modules: list[tuple[str, list[int]]], num_prompts: int, continuation: int, min_prompt: int,
                max_prompt: int, per_module_cap: int, seed: int) -> list[Chunk]:
    """Sample prompt windows (log-uniform length) spread over modules; a module gives at most `per_module_cap`."""
    rng = np.random.default_rng(seed)
    candidates: list[tuple[str, int, int]] = []
    for name, ids in modules:
        if len(ids) < min_prompt + continuation:
            continue
        room = len(ids) - continuation
        # one candidate per ~32 tokens of the module, each with its own prompt length
        count = min(per_module_cap, max(1, room // 32))
        for _ in range(count):
            length = int(round(np.exp(rng.uniform(np.log(min_prompt), np.log(max_prompt)))))
            length = min(length, room)
            start = int(rng.integers(0, room - length + 1))
            candidates.append((name, start, length))
    if len(candidates) > num_prompts:
        keep = rng.choice(len(candidates), size=num_prompts, replace=False)
        candidates = [candidates[i] for i in sorted(keep)]
    by_name = dict(modules)
    return [Chunk(name, start, by_name[name][start:start + length],
                  by_name[name][start + length:start + length + continuation]) for name, start, length in candidates]


def score_chunks(model, chunks: list[Chunk], batch_size: int = 32,
                 pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean continuation log-prob, mean prompt log-prob, continuation top-1 accuracy) per chunk, teacher-forced
    with `dense_logits`; top-1 accuracy is the share of continuation tokens the model's argmax gets right.

    Rows are right-padded to the batch's longest; causal attention means padding never affects real positions.
    """
    import torch

    cont_lp = np.zeros(len(chunks))
    prompt_lp = np.zeros(len(chunks))
    cont_acc = np.zeros(len(chunks))
    order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].prompt_ids) + len(chunks[i].continuation_ids))
    with torch.inference_mode():
        for b in range(0, len(order), batch_size):
            rows = order[b:b + batch_size]
            seqs = [chunks[i].prompt_ids + chunks[i].continuation_ids for i in rows]
            width = max(map(len, seqs))
            ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
            for r, s in enumerate(seqs):
                ids[r, :len(s)] = torch.tensor(s)
            logits = model.dense_logits(ids).float()
            # log p(token t+1 | tokens <= t) for every position t
            lp = (logits[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(logits[:, :-1], -1))
            hit = (logits[:, :-1].argmax(-1) == ids[:, 1:]).numpy()
            lp = lp.numpy()
            for r, i in enumerate(rows):
                p = len(chunks[i].prompt_ids)
                n = len(chunks[i].continuation_ids)
                cont_lp[i] = lp[r, p - 1:p - 1 + n].mean()
                prompt_lp[i] = lp[r, :p - 1].mean() if p > 1 else 0.0
                cont_acc[i] = hit[r, p - 1:p - 1 + n].mean()
    return cont_lp, prompt_lp, cont_acc


def build(small_dir: Path, large_dir: Path, out_dir: Path, num_prompts: int, continuation: int,
          min_prompt: int, max_prompt: int, per_module_cap: int, test_fraction: float, batch_size: int,
          seed: int, splits: tuple[str, ...] = ("heldout",), score: str = "logprob", log=print) -> dict:
    """Write train.jsonl / test.jsonl (split by module) and summary.json; `score` picks what small_score and
    large_score hold ("logprob": mean continuation log-prob; "accuracy": top-1 accuracy); both are kept."""
    from engines.loader import load_checkpoint
    from engines.tokenizer import Tokenizer
    from training.corpus import load_corpus_split

    t0 = time.perf_counter()
    if (small_dir / "tokenizer.json").read_bytes() != (large_dir / "tokenizer.json").read_bytes():
        raise ValueError(f"{small_dir} and {large_dir} use different tokenizers: their scores are not comparable")
    tok = Tokenizer.from_pretrained(small_dir)
    if "train" in splits:
        raise ValueError("the models trained on the 'train' split: label prompts must come from unseen modules")
    modules = [(name, tok.encode(text)) for split in splits for name, text in load_corpus_split(split)]
    chunks = make_chunks(modules, num_prompts, continuation, min_prompt, max_prompt, per_module_cap, seed)
    log(f"{len(chunks)} prompts from {len({c.module for c in chunks})} modules of {'+'.join(splits)} "
        f"({time.perf_counter() - t0:.1f}s)")

    scores = {}
    for role, folder in (("small", small_dir), ("large", large_dir)):
        t = time.perf_counter()
        ckpt = load_checkpoint(folder, dtype="float32")
        pad = min(ckpt.eos_token_ids) if ckpt.eos_token_ids else 0
        scores[role] = score_chunks(ckpt.model, chunks, batch_size, pad)
        del ckpt
        log(f"scored {role} ({folder}) in {time.perf_counter() - t:.1f}s: "
            f"mean continuation log-prob {scores[role][0].mean():.4f}, top-1 accuracy {scores[role][2].mean():.3f}")

    out_dir.mkdir(parents=True, exist_ok=True)
    files = {side: open(out_dir / f"{side}.jsonl", "w", encoding="utf-8") for side in ("train", "test")}
    counts = {"train": 0, "test": 0}
    try:
        for i, c in enumerate(chunks):
            side = module_side(c.module, test_fraction)
            pick = 0 if score == "logprob" else 2
            row = {
                "prompt": tok.decode(c.prompt_ids, skip_special_tokens=False),
                "small_score": round(float(scores["small"][pick][i]), 6),
                "large_score": round(float(scores["large"][pick][i]), 6),
                "small_logprob": round(float(scores["small"][0][i]), 6),
                "large_logprob": round(float(scores["large"][0][i]), 6),
                "small_accuracy": round(float(scores["small"][2][i]), 6),
                "large_accuracy": round(float(scores["large"][2][i]), 6),
                "group": c.module,
                "extras": {"small_prompt_logprob": round(float(scores["small"][1][i]), 6)},
                "prompt_tokens": len(c.prompt_ids),
                "start_token": c.start,
            }
            files[side].write(json.dumps(row, ensure_ascii=False) + "\n")
            counts[side] += 1
    finally:
        for f in files.values():
            f.close()
    summary = {
        "small": str(small_dir), "large": str(large_dir), "splits": list(splits), "prompts": len(chunks),
        "train": counts["train"], "test": counts["test"], "continuation_tokens": continuation,
        "prompt_tokens": [min_prompt, max_prompt], "seed": seed, "test_fraction": test_fraction,
        "score": score,
        "mean_small_logprob": float(scores["small"][0].mean()), "mean_large_logprob": float(scores["large"][0].mean()),
        "mean_small_accuracy": float(scores["small"][2].mean()),
        "mean_large_accuracy": float(scores["large"][2].mean()),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"wrote {counts['train']} train / {counts['test']} test rows to {out_dir} in {summary['seconds']}s")
    return summary


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tandem router label", description=__doc__.splitlines()[0])
    p.add_argument("--small", default="models/tandem-tiny-s")
    p.add_argument("--large", default="models/tandem-tiny-l")
    p.add_argument("--out-dir", default="models/router/labels", help="writes train.jsonl, test.jsonl, summary.json")
    p.add_argument("--splits", nargs="+", default=["heldout", "validation"], choices=("heldout", "validation"),
                   help="corpus splits the prompts come from: modules the models never trained on")
    p.add_argument("--num-prompts", type=int, default=5000)
    p.add_argument("--continuation", type=int, default=48, help="tokens of true continuation scored")
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=208, help="prompt + continuation stays within training length")
    p.add_argument("--per-module-cap", type=int, default=400)
    p.add_argument("--test-fraction", type=float, default=0.35, help="share of modules held out as the test set")
    p.add_argument("--score", choices=("logprob", "accuracy"), default="logprob",
                   help="quality written as small_score/large_score: mean continuation log-prob (default) or top-1 "
                        "accuracy on the continuation; both are always kept in the rows")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        build(Path(args.small), Path(args.large), Path(args.out_dir), args.num_prompts, args.continuation,
              args.min_prompt, args.max_prompt, args.per_module_cap, args.test_fraction, args.batch_size,
              args.seed, tuple(args.splits), args.score)
    except (OSError, ValueError) as e:
        print(f"tandem router label: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
