"""The shifted traffic of bench/routing_shift.py: line-completion prompts from a package family the models and the
router never saw (pygments in the venv's site-packages: lexers, mostly tables of regular expressions and token types, where the
training modules are the CPython standard library), split by module into unlabelled traffic (what adaptation may
read) and an evaluation set with reference labels made by transformers (greedy, each model, exact match and edit
similarity against the true line), never by tandem's engines. Everything is cached under bench/cache/ (ignored).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "bench" / "cache" / "routing_shift"
FAMILY = "pygments"
_SKIP = {"tests", "test", "__pycache__"}
# every answer's budget, as the traffic's (`tandem router adapt --max-tokens 44`): lines are at most 40 tokens;
# a budget cut to the reference's length would tell the answers where the line ends, which traffic never does
ANSWER_BUDGET = 44


def family_modules(family: str = FAMILY) -> list[tuple[str, str]]:
    """(dotted module name, source) of every non-test module of an installed package, sorted by name."""
    import importlib.util

    spec = importlib.util.find_spec(family)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {family!r} is not installed in this interpreter")
    root = Path(next(iter(spec.submodule_search_locations)))
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        if any(p in _SKIP for p in rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            out.append((".".join(rel.with_suffix("").parts), text))
    return out


def side_of(module: str) -> str:
    """'traffic' (unlabelled, for adaptation) or 'eval' (references) by a stable hash of the module name."""
    return "eval" if hashlib.sha256(f"shift:{module}".encode()).digest()[0] < 128 else "traffic"


def build_prompts(small_dir: Path, traffic: int, evaluation: int, seed: int = 0, per_module_cap: int = 40,
                  family: str = FAMILY) -> dict:
    """{'traffic': [...], 'eval': [...]}: rows {prompt, reference, group, max_tokens}, in a random order."""
    from engines.tokenizer import Tokenizer
    from router_model.labels import line_prompts, token_pieces

    tok = Tokenizer.from_pretrained(small_dir)
    pieces = token_pieces(tok)
    out: dict[str, list[dict]] = {"traffic": [], "eval": []}
    mods = family_modules(family)
    for side, want in (("traffic", traffic), ("eval", evaluation)):
        chosen = [(name, tok.encode(text)) for name, text in mods if side_of(name) == side]
        prompts = line_prompts(chosen, pieces, tok.decode, per_module_cap, 32, 256, 40, seed)
        rng = np.random.default_rng(seed + (side == "eval"))
        order = rng.permutation(len(prompts))[:want]
        for i in order:
            p = prompts[i]
            out[side].append({"prompt": tok.decode(p.prompt_ids, skip_special_tokens=False),
                              "prompt_token_ids": p.prompt_ids, "reference": p.reference, "group": p.module,
                              "line_tokens": p.line_tokens, "max_tokens": ANSWER_BUDGET})
    return out


def _stats_of(token_ids: list[int], step_logprobs: list, pieces: list[str]) -> dict[str, float]:
    from router_model.scoring import answer_stats

    return {k: round(v, 5) for k, v in answer_stats(token_ids, step_logprobs, pieces).items()}


def transformers_lines(model_dir: Path, prompts: list[list[int]], max_tokens: list[int], want_stats: bool,
                       batch: int = 128, log=print) -> tuple[list[str], list[dict] | None]:
    """Greedy line completions by transformers' own LlamaForCausalLM (float32, left-padded batches of similar
    length), cut at the first newline; with `want_stats` the small answer's top-5 logprob statistics."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from router_model.scoring import ENTROPY_TOP_K

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else 1
    texts: list[str] = [""] * len(prompts)
    stats: list[dict] = [{}] * len(prompts)
    order = np.argsort([len(p) for p in prompts], kind="stable")
    t0 = time.perf_counter()
    for b in range(0, len(order), batch):
        idx = order[b:b + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max(max_tokens[i] for i in idx), pad_token_id=pad,
                                 output_scores=want_stats, return_dict_in_generate=True)
        new = gen.sequences[:, width:]
        for r, i in enumerate(idx):
            toks: list[int] = []
            lps: list[dict] = []
            for s, t in enumerate(new[r].tolist()[:max_tokens[i]]):
                piece = tok.decode([t])
                toks.append(t)
                if want_stats:
                    logp = torch.log_softmax(gen.scores[s][r].float(), -1)
                    top = torch.topk(logp, ENTROPY_TOP_K)
                    pos = {int(k): float(v) for k, v in zip(top.indices, top.values)}
                    pos[t] = float(logp[t])
                    lps.append(pos)
                if "\n" in piece or t in (tok.eos_token_id, pad):
                    break
            text = tok.decode(toks)
            texts[i] = text.split("\n")[0]
            if want_stats:
                stats[i] = _stats_of(toks, lps, [tok.decode([t]) for t in toks])
        log(f"  transformers {model_dir.name}: {min(b + batch, len(order))}/{len(order)} "
            f"({(time.perf_counter() - t0):.0f}s)")
    return texts, (stats if want_stats else None)


def reference_rows(rows: list[dict], small_dir: Path, large_dir: Path, log=print) -> list[dict]:
    """Each evaluation row with both transformers answers scored against the true line (+ small answer stats)."""
    from router_model.scoring import edit_similarity, exact_match

    ids = [r["prompt_token_ids"] for r in rows]
    budget = [r["max_tokens"] for r in rows]
    small, small_stats = transformers_lines(small_dir, ids, budget, True, log=log)
    large, _ = transformers_lines(large_dir, ids, budget, False, log=log)
    out = []
    for r, s, st, g in zip(rows, small, small_stats, large):
        row = {k: v for k, v in r.items() if k != "prompt_token_ids"}
        for role, text in (("small", s), ("large", g)):
            row[f"{role}_answer"] = text
            row[f"{role}_exact"] = exact_match(text, r["reference"])
            row[f"{role}_edit"] = round(edit_similarity(text, r["reference"]), 4)
        row["small_score"], row["large_score"] = row["small_exact"], row["large_exact"]
        row["small_answer_stats"] = st
        out.append(row)
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def ensure(small_dir: Path, large_dir: Path, traffic: int = 2000, evaluation: int = 4000, log=print) -> dict:
    """The cached traffic prompts (unlabelled JSONL for `tandem router adapt`) and evaluation references."""
    CACHE.mkdir(parents=True, exist_ok=True)
    traffic_path, eval_path = CACHE / "traffic.jsonl", CACHE / "eval_refs.jsonl.gz"
    if not traffic_path.is_file() or not eval_path.is_file():
        data = build_prompts(small_dir, traffic, evaluation)
        log(f"{len(data['traffic'])} traffic prompts from {len({r['group'] for r in data['traffic']})} modules, "
            f"{len(data['eval'])} evaluation prompts from {len({r['group'] for r in data['eval']})} modules")
        if not eval_path.is_file():
            t = time.perf_counter()
            write_jsonl(eval_path, reference_rows(data["eval"], small_dir, large_dir, log=log))
            log(f"references in {time.perf_counter() - t:.0f}s -> {eval_path}")
        with traffic_path.open("w", encoding="utf-8") as f:  # what the traffic is: prompts, nothing more
            for r in data["traffic"]:
                f.write(json.dumps({"prompt": r["prompt"], "group": r["group"]}, ensure_ascii=False) + "\n")
    return {"traffic": traffic_path, "eval": eval_path}


def main() -> int:
    """Build (or find) the cached sets and write what they hold to bench/results/routing_shift_data.json."""
    import torch

    from bench.results_meta import write_results

    torch.set_num_threads(1)
    paths = ensure(ROOT / "models/tandem-tiny-s", ROOT / "models/tandem-tiny-l")
    rows = read_jsonl(paths["eval"])
    with paths["traffic"].open(encoding="utf-8") as f:
        traffic = [json.loads(line) for line in f if line.strip()]
    summary = {"family": FAMILY, "answer_budget": ANSWER_BUDGET, "traffic_prompts": len(traffic),
               "traffic_modules": len({r["group"] for r in traffic}), "eval_prompts": len(rows),
               "eval_modules": len({r["group"] for r in rows}),
               "eval_exact": {m: float(np.mean([r[f"{m}_exact"] for r in rows])) for m in ("small", "large")},
               "large_only_right": sum(r["large_exact"] > r["small_exact"] for r in rows),
               "small_only_right": sum(r["small_exact"] > r["large_exact"] for r in rows)}
    print(json.dumps(summary, indent=1))
    write_results(ROOT / "bench/results/routing_shift_data.json", summary, indent=2)
    return 0


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(ROOT))
    sys.exit(main())
