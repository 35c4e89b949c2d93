"""How well the default draft matches the large model's sampling distribution: the rejection sampler's
acceptance probability sum_x min(p(x), q(x)) at every position of held-out windows (teacher-forced), for the
large model at temperature T and the draft at several temperatures (and greedy drafts: p(argmax q)). Prints a
table, writes bench/results/draft_match.json.

    .venv/bin/python bench/draft_match.py        # about 20 s
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402
from engines.loader import load_checkpoint  # noqa: E402
from engines.tokenizer import Tokenizer  # noqa: E402
from training.corpus import load_corpus_split  # noqa: E402

LARGE, SMALL = ROOT / "models" / "tandem-tiny-l", ROOT / "models" / "tandem-tiny-s"
DRAFT_TEMPS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def main() -> int:
    torch.set_num_threads(1)
    large = load_checkpoint(LARGE, dtype="float32", device="cpu").model.eval()
    small = load_checkpoint(SMALL, dtype="float32", device="cpu").model.eval()
    tok = Tokenizer.from_pretrained(LARGE)
    rng = random.Random(0)
    modules = [text for _, text in load_corpus_split("heldout") if len(text) > 4000]
    windows: list[list[int]] = []
    while len(windows) < 48:  # 48 windows x 128 scored positions (after 64 tokens of context)
        text = rng.choice(modules)
        start = rng.randrange(0, len(text) - 3000)
        ids = tok.encode(text[start:start + 2500])
        if len(ids) >= 192:
            windows.append(ids[:192])
    x = torch.tensor(windows)
    with torch.inference_mode():
        lp = large.dense_logits(x)[:, 64:].reshape(-1, large.config.vocab_size).float()
        lq = small.dense_logits(x)[:, 64:].reshape(-1, small.config.vocab_size).float()
    rows = []
    for t in (0.8, 1.0):
        p = torch.softmax(lp / t, -1)
        row = {"target_temperature": t, "greedy_draft": round(p.gather(1, lq.argmax(-1, keepdim=True)).mean().item(), 4)}
        for tq in DRAFT_TEMPS:
            row[f"draft_T{tq}"] = round(torch.minimum(p, torch.softmax(lq / tq, -1)).sum(-1).mean().item(), 4)
        rows.append(row)
    print("| target T | greedy draft | " + " | ".join(f"draft T={t}" for t in DRAFT_TEMPS) + " |")
    print("|---" * (2 + len(DRAFT_TEMPS)) + "|")
    for r in rows:
        print(f"| {r['target_temperature']} | {r['greedy_draft']} | "
              + " | ".join(str(r[f'draft_T{t}']) for t in DRAFT_TEMPS) + " |")
    out = ROOT / "bench" / "results" / "draft_match.json"
    write_results(out, {"positions": int(lp.shape[0]), "rows": rows}, indent=2)
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
