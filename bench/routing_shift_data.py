"""The shifted traffic of bench/routing_shift.py: line-completion prompts from a package family the models and the
router never saw (one or more installed packages of the venv's site-packages, e.g. pygments: lexers, mostly tables
of regular expressions and token types; the training modules are the CPython standard library), split by module
into unlabelled traffic (what adaptation may read) and an evaluation set with reference labels made by transformers
(greedy, each model, exact match and edit similarity against the true line), never by tandem's engines. Everything
is cached under bench/cache/routing_shift/FAMILY/ (ignored). `--probe N` measures a few families' exact-match
rates on N prompts of their traffic side (never their evaluation modules), to choose one.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CACHE_ROOT = ROOT / "bench" / "cache" / "routing_shift"
DEFAULT_FAMILY = "pygments"
_SKIP = {"tests", "test", "__pycache__"}
# every answer's budget, as the traffic's (`tandem router adapt --max-tokens 44`): lines are at most 40 tokens;
# a budget cut to the reference's length would tell the answers where the line ends, which traffic never does
ANSWER_BUDGET = 44


def packages_of(family: str) -> list[str]:
    """'httpx,httpcore' -> ['httpx', 'httpcore']: a family is one package or several, comma-separated."""
    names = [p.strip() for p in family.split(",") if p.strip()]
    if not names:
        raise SystemExit(f"empty package family {family!r}")
    return names


def family_key(family: str) -> str:
    """The name results and caches are keyed by: the packages joined with '+' ('httpx+httpcore')."""
    return "+".join(packages_of(family))


def cache_dir(family: str) -> Path:
    return CACHE_ROOT / family_key(family)


def family_modules(family: str = DEFAULT_FAMILY) -> list[tuple[str, str]]:
    """(dotted module name, source) of every non-test module of the family's installed packages, sorted."""
    out = []
    for package in packages_of(family):
        out += _package_modules(package)
    return sorted(out)


def _package_modules(package: str) -> list[tuple[str, str]]:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {package!r} is not installed in this interpreter")
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
                  family: str = DEFAULT_FAMILY) -> dict:
    """{'traffic': [...], 'eval': [...]}: rows {prompt, reference, group, max_tokens}, in a random order."""
    from engines.tokenizer import Tokenizer
    from router_model.labels import line_prompts, token_pieces

    tok = Tokenizer.from_pretrained(small_dir)
    pieces = token_pieces(tok)
    out: dict[str, list[dict]] = {"traffic": [], "eval": []}
    mods = family_modules(family)
    for side, want in (("traffic", traffic), ("eval", evaluation)):
        chosen = [(name, tok.encode(text)) for name, text in mods if side_of(name) == side]
        if not want:
            continue
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


def ensure(small_dir: Path, large_dir: Path, traffic: int = 2000, evaluation: int = 4000, log=print,
           family: str = DEFAULT_FAMILY) -> dict:
    """The cached traffic prompts (unlabelled JSONL for `tandem router adapt`) and evaluation references."""
    cache = cache_dir(family)
    cache.mkdir(parents=True, exist_ok=True)
    traffic_path, eval_path = cache / "traffic.jsonl", cache / "eval_refs.jsonl.gz"
    if not traffic_path.is_file() or not eval_path.is_file():
        data = build_prompts(small_dir, traffic, evaluation, family=family)
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


def summarize(rows: list[dict]) -> dict:
    """Both models' exact-match and edit rates on reference rows, and the prompts only one of them gets right."""
    exact = {m: float(np.mean([r[f"{m}_exact"] for r in rows])) for m in ("small", "large")}
    return {"prompts": len(rows), "modules": len({r["group"] for r in rows}), "exact": exact,
            "edit": {m: float(np.mean([r[f"{m}_edit"] for r in rows])) for m in ("small", "large")},
            "gap": exact["large"] - exact["small"],
            "large_only_right": sum(r["large_exact"] > r["small_exact"] for r in rows),
            "small_only_right": sum(r["small_exact"] > r["large_exact"] for r in rows)}


def probe(family: str, n: int, small_dir: Path, large_dir: Path, log=print) -> dict:
    """References on `n` prompts of the family's traffic side (its evaluation modules are never looked at)."""
    t = time.perf_counter()
    rows = build_prompts(small_dir, n, 0, family=family)["traffic"]
    out = summarize(reference_rows(rows, small_dir, large_dir, log=lambda *_: None))
    out["seconds"] = round(time.perf_counter() - t, 1)
    out["load_average"] = round(os.getloadavg()[0], 2)
    log(f"{family_key(family):<24} {out['prompts']:5d} prompts {out['modules']:4d} modules  EM small "
        f"{out['exact']['small']:.3f} large {out['exact']['large']:.3f} gap {out['gap']:+.3f}  large-only "
        f"{out['large_only_right']:4d} small-only {out['small_only_right']:4d}  ({out['seconds']:.0f}s, load "
        f"{os.getloadavg()[0]:.1f})")
    return out


def main(argv: list[str] | None = None) -> int:
    """Build (or find) a family's cached sets and write what they hold to
    bench/results/routing_shift_data[_FAMILY].json; or with --probe N, each family's rates on N traffic prompts
    (merged into bench/results/routing_shift_probe.json, keyed by family)."""
    import argparse

    import torch

    from bench.results_meta import write_results

    ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    ap.add_argument("--family", nargs="+", default=[DEFAULT_FAMILY],
                    help="package family, several packages comma-separated (with --probe: several families)")
    ap.add_argument("--probe", type=int, default=0, help="prompts per family to probe (0: build the sets)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    small_dir, large_dir = ROOT / "models/tandem-tiny-s", ROOT / "models/tandem-tiny-l"
    if args.probe:
        path = ROOT / "bench/results/routing_shift_probe.json"
        found = json.loads(path.read_text())["families"] if path.is_file() else {}
        for family in args.family:
            found[family_key(family)] = probe(family, args.probe, small_dir, large_dir)
        write_results(path, {"prompts_per_family": args.probe, "side": "traffic", "answer_budget": ANSWER_BUDGET,
                             "families": found}, indent=2)
        return 0
    if len(args.family) != 1:
        raise SystemExit("building the sets takes one family (several packages comma-separated)")
    family = args.family[0]
    paths = ensure(small_dir, large_dir, family=family)
    rows = read_jsonl(paths["eval"])
    with paths["traffic"].open(encoding="utf-8") as f:
        traffic = [json.loads(line) for line in f if line.strip()]
    s = summarize(rows)
    summary = {"family": family_key(family), "answer_budget": ANSWER_BUDGET, "traffic_prompts": len(traffic),
               "traffic_modules": len({r["group"] for r in traffic}), "eval_prompts": len(rows),
               "eval_modules": s["modules"], "eval_exact": s["exact"], "eval_edit": s["edit"],
               "large_only_right": s["large_only_right"], "small_only_right": s["small_only_right"]}
    print(json.dumps(summary, indent=1))
    suffix = "" if family_key(family) == DEFAULT_FAMILY else f"_{family_key(family)}"
    write_results(ROOT / f"bench/results/routing_shift_data{suffix}.json", summary, indent=2)
    return 0


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(ROOT))
    sys.exit(main())
