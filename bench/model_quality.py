"""Quality table of the embedded default models: held-out loss and perplexity of each, the greedy acceptance
rate of the small one drafting for the large one (k tokens per round, simulated exactly), and sample
completions. Prints a table and writes bench/results/model_quality.json.

    .venv/bin/python bench/model_quality.py [--small models/tandem-tiny-s] [--large models/tandem-tiny-l]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402
from engines.generate_cli import generate_tokens  # noqa: E402
from engines.loader import load_checkpoint  # noqa: E402
from engines.model import Transformer  # noqa: E402
from engines.tokenizer import Tokenizer  # noqa: E402
from training.corpus import load_corpus_split  # noqa: E402

# No trailing newline or space: byte-level BPE merges "\n" with the next line's indentation (and " " with the
# next word), so a prompt that stops on one would tell the model the next line starts at column 0.
SAMPLE_PROMPTS = ["def read_config(path):", "class Stack:\n    def __init__(self):", "import os\n\n\ndef"]


def heldout_token_chunks(tokenizer: Tokenizer, seq_len: int = 256, limit: int | None = None) -> list[list[int]]:
    """Held-out modules cut into non-overlapping `seq_len + 1`-token chunks, module by module in name order.

    With `limit`, the chunks are taken evenly across all held-out modules instead of the first ones.
    """
    chunks = []
    for _, text in load_corpus_split("heldout"):
        ids = tokenizer.encode(text)
        for start in range(0, len(ids) - seq_len, seq_len):
            chunks.append(ids[start:start + seq_len + 1])
    if limit is not None and limit < len(chunks):
        step = len(chunks) / limit
        chunks = [chunks[int(i * step)] for i in range(limit)]
    return chunks


@torch.inference_mode()
def mean_loss(model: Transformer, chunks: list[list[int]], batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats/token) of `model` over the chunks."""
    total, count = 0.0, 0
    for i in range(0, len(chunks), batch_size):
        x = torch.tensor(chunks[i:i + batch_size], dtype=torch.long)
        logits = model.dense_logits(x[:, :-1]).float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        count += x[:, 1:].numel()
    return total / count


def heldout_prompts(tokenizer: Tokenizer, n: int, context_tokens: int = 96) -> list[list[int]]:
    """Prompts ending right after the colon of a `def ...:` line of a held-out module (not after its newline,
    which BPE would merge with the next line's indentation), with up to `context_tokens` of context.

    Taken evenly across the held-out functions so no one module dominates.
    """
    candidates = []
    for _, text in load_corpus_split("heldout"):
        lines = text.splitlines(keepends=True)
        offset = 0
        for line in lines:
            offset += len(line)
            if line.lstrip().startswith("def ") and line.rstrip().endswith(":"):
                candidates.append(text[:offset].rstrip("\r\n"))
    if not candidates:
        raise RuntimeError("no held-out function definitions found")
    step = len(candidates) / n
    picked = [candidates[int(i * step)] for i in range(min(n, len(candidates)))]
    return [tokenizer.encode(p)[-context_tokens:] for p in picked]


@torch.inference_mode()
def greedy_acceptance(small: Transformer, large: Transformer, prompts: list[list[int]], k: int = 4,
                      max_tokens: int = 48, eos_ids: frozenset[int] = frozenset()) -> dict:
    """Greedy speculative decoding, simulated exactly.

    The verified output of greedy speculative decoding is the large model's greedy continuation, so it is
    computed once. Each round the small model drafts up to k tokens greedily from the accepted prefix; drafts
    count as accepted up to the first mismatch with the large continuation, then the large model's own token
    follows (the correction, or the bonus token after a full accept). acceptance = accepted / drafted.
    A draft token is only accepted when every draft before it matched, i.e. when its prefix *is* the large
    continuation; so one forward of the small model over prompt + continuation decides every round.
    """
    accepted = drafted = rounds = 0
    for prompt in prompts:
        target = generate_tokens(large, prompt, max_tokens, eos_ids=eos_ids)
        ids = torch.tensor([prompt + target], dtype=torch.long)
        guesses = small.dense_logits(ids)[0, len(prompt) - 1:-1].argmax(-1).tolist()
        match = [g == t for g, t in zip(guesses, target)]
        pos = 0
        while pos < len(target):
            n_draft = min(k, len(target) - pos)
            good = 0
            while good < n_draft and match[pos + good]:
                good += 1
            accepted += good
            drafted += n_draft
            rounds += 1
            pos += good + 1  # the large model's token after the accepted drafts
    return {"k": k, "accepted": accepted, "drafted": drafted, "rounds": rounds,
            "acceptance": accepted / drafted if drafted else 0.0,
            "tokens_per_round": (accepted + rounds) / rounds if rounds else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", default=str(ROOT / "models" / "tandem-tiny-s"))
    p.add_argument("--large", default=str(ROOT / "models" / "tandem-tiny-l"))
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--prompts", type=int, default=32, help="held-out prompts for the acceptance rate")
    p.add_argument("--max-tokens", type=int, default=48, help="large-model tokens per acceptance prompt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "model_quality.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    t0 = time.monotonic()
    models = {"small": load_checkpoint(args.small), "large": load_checkpoint(args.large)}
    tokenizer = Tokenizer.from_pretrained(args.small)
    eos = frozenset(tokenizer.eos_token_ids)
    chunks = heldout_token_chunks(tokenizer)
    result: dict = {"heldout_tokens": len(chunks) * 256, "models": {}}
    for role, ckpt in models.items():
        loss = mean_loss(ckpt.model, chunks)
        meta_path = Path(ckpt.path) / "training_meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        samples = []
        for prompt in SAMPLE_PROMPTS:
            out = generate_tokens(ckpt.model, tokenizer.encode(prompt), 48, eos_ids=eos)
            samples.append({"prompt": prompt, "completion": tokenizer.decode(out)})
        result["models"][role] = {
            "path": str(ckpt.path), "params": sum(p.numel() for p in ckpt.model.parameters()),
            "train_tokens": meta.get("tokens"), "train_steps": meta.get("steps"),
            "heldout_loss": round(loss, 4), "heldout_ppl": round(math.exp(loss), 3), "samples": samples,
        }
    result["loss_gap"] = round(result["models"]["small"]["heldout_loss"] - result["models"]["large"]["heldout_loss"], 4)
    prompts = heldout_prompts(tokenizer, args.prompts)
    result["speculative"] = greedy_acceptance(models["small"].model, models["large"].model, prompts, args.k,
                                              args.max_tokens, eos)
    result["speculative"]["prompts"] = len(prompts)
    result["elapsed_s"] = round(time.monotonic() - t0, 1)

    print(f"{'model':<8}{'params':>10}{'train tokens':>14}{'held-out loss':>15}{'ppl':>9}")
    for role, m in result["models"].items():
        print(f"{role:<8}{m['params']:>10,}{m['train_tokens'] or 0:>14,}{m['heldout_loss']:>15.4f}{m['heldout_ppl']:>9.2f}")
    s = result["speculative"]
    print(f"loss gap (small - large): {result['loss_gap']:.4f} nats/token over {result['heldout_tokens']:,} tokens")
    print(f"greedy acceptance, k={s['k']}: {s['acceptance']:.3f} ({s['accepted']}/{s['drafted']} drafts, "
          f"{s['tokens_per_round']:.2f} tokens per large step, {s['prompts']} held-out prompts)")
    for role, m in result["models"].items():
        for sample in m["samples"]:
            print(f"--- {role}: {sample['prompt']!r}\n{sample['prompt']}{sample['completion']}")
    out = Path(args.out)
    write_results(out, result, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
