"""Router labels for your own model pair and traffic: `tandem router label --data prompts.jsonl`.

Each line of `prompts.jsonl` is one of three forms (they may be mixed):

- a prompt with a reference answer: `{"prompt": ..., "reference": ...}` (or `messages` for chat; the engines'
  chat template renders them). Both engines (`--small`, `--large`: checkpoint folders) answer greedily and each
  answer is scored against the reference by `--metric`: `exact` (whitespace-normalised exact match), `edit`
  (edit similarity in [0, 1]) or `command` (`--score-command CMD` reads JSONL `{"prompt", "reference",
  "answer"}` on stdin and prints one number per line). The small answer's text and logprob statistics are kept,
  so the cascade's escalation scorer can train on the same file.
- judge scores: `{"prompt": ..., "small_score": 7, "large_score": 9}` (any scale, higher is better), kept as is.
- a RouteLLM-style preference battle: `{"prompt": ..., "model_a": ..., "model_b": ..., "winner": "model_a" |
  "model_b" | "tie" | "tie (bothbad)"}` between the models named `--small-name` and `--large-name`: the winner
  scores 1 and the loser 0; a tie 1/1, both bad 0/0. Battles between other models are skipped (counted).

Writes train.jsonl / test.jsonl (split by each line's `group`, else by the prompt, with a stable hash) and
summary.json; `tandem router train --data DIR/train.jsonl` and `tandem router eval --data DIR/test.jsonl` follow.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from router_model.data import DataError, read_rows, write_examples
from router_model.scoring import ENTROPY_TOP_K, answer_stats, edit_similarity, exact_match

WINNERS = ("model_a", "model_b", "tie", "tie (bothbad)")


def _side(key: str, test_fraction: float) -> str:
    bucket = int.from_bytes(hashlib.sha256(f"router:{key}".encode()).digest()[:8], "big") % 1000
    return "test" if bucket < test_fraction * 1000 else "train"


def _prompt_of(row: dict, where: str) -> Any:
    if isinstance(row.get("prompt"), str):
        return row["prompt"]
    if isinstance(row.get("messages"), list) and row["messages"]:
        return row["messages"]
    raise DataError(f"{where}: needs a 'prompt' string or a 'messages' list")


def battle_scores(row: dict, small_name: str, large_name: str, where: str) -> tuple[float, float] | None:
    """(small, large) from a preference battle, or None when the battle is not between the two models."""
    a, b, winner = row.get("model_a"), row.get("model_b"), row.get("winner")
    if winner not in WINNERS:
        raise DataError(f"{where}: 'winner' must be one of {', '.join(WINNERS)}, got {winner!r}")
    if {a, b} != {small_name, large_name}:
        return None
    if winner == "tie":
        return 1.0, 1.0
    if winner == "tie (bothbad)":
        return 0.0, 0.0
    won = a if winner == "model_a" else b
    return (1.0, 0.0) if won == small_name else (0.0, 1.0)


def score_command(command: str, items: list[dict]) -> list[float]:
    """Run the user's scorer once over all answers: JSONL in on stdin, one number per line out."""
    payload = "".join(json.dumps(i, ensure_ascii=False) + "\n" for i in items)
    res = subprocess.run(shlex.split(command), input=payload, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise DataError(f"--score-command {command!r} failed ({res.returncode}): {res.stderr.strip()[-300:]}")
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    if len(lines) != len(items):
        raise DataError(f"--score-command printed {len(lines)} numbers for {len(items)} answers")
    try:
        return [float(v) for v in lines]
    except ValueError as e:
        raise DataError(f"--score-command printed a non-number: {e}") from None


def labelling_engine(model_dir: str, prompts: list, **engine_options) -> tuple[Any, list[str]]:
    """An offline engine for labelling and each prompt as text (a 'messages' list through its chat template)."""
    from engines import LLM

    options = {"max_num_seqs": 128, "max_num_batched_tokens": 4096, "memory_bytes": 256 << 20} | engine_options
    llm = LLM(model=str(model_dir), **options)
    texts = []
    for p in prompts:
        if isinstance(p, list):
            if not llm.tokenizer.has_chat_template:
                raise DataError(f"{model_dir} has no chat template: give 'prompt' strings instead of 'messages'")
            texts.append(llm.tokenizer.apply_chat_template(p, add_generation_prompt=True))
        else:
            texts.append(p)
    return llm, texts


def generate(model_dir: str, prompts: list, max_tokens: int, stop: list[str], want_stats: bool,
             **engine_options) -> tuple[list[str], list[dict] | None]:
    """Greedy answers of one engine to every prompt (one batched generate call)."""
    from engines import SamplingParams

    llm, texts = labelling_engine(model_dir, prompts, **engine_options)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=list(stop),
                            logprobs=ENTROPY_TOP_K if want_stats else None)
    outs = llm.generate(texts, params)
    answers = [o.outputs[0].text for o in outs]
    if not want_stats:
        return answers, None
    stats = []
    for o in outs:
        c = o.outputs[0]
        pieces = [llm.tokenizer.decode([t], skip_special_tokens=False) for t in c.token_ids]
        stats.append({k: round(v, 5) for k, v in answer_stats(c.token_ids, c.logprobs, pieces).items()})
    return answers, stats


def build(data: Path, out_dir: Path, *, small: str | None, large: str | None, metric: str = "exact",
          score_cmd: str | None = None, small_name: str | None = None, large_name: str | None = None,
          max_tokens: int = 64, stop: tuple[str, ...] = (), test_fraction: float = 0.3, log=print,
          **engine_options) -> dict:
    t0 = time.perf_counter()
    rows = read_rows(data)
    small_name = small_name or (Path(small).name if small else "small")
    large_name = large_name or (Path(large).name if large else "large")
    out: list[dict | None] = [None] * len(rows)
    to_generate = []
    skipped = 0
    forms = {"reference": 0, "judge": 0, "battle": 0}
    for i, row in enumerate(rows):
        where = f"{data}:{i + 1}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: each line must be a JSON object")
        prompt = _prompt_of(row, where)
        base = {("messages" if isinstance(prompt, list) else "prompt"): prompt}
        if row.get("group") is not None:
            base["group"] = str(row["group"])
        if "winner" in row:
            scores = battle_scores(row, small_name, large_name, where)
            if scores is None:
                skipped += 1
                continue
            out[i] = base | {"small_score": scores[0], "large_score": scores[1], "source": "battle"}
            forms["battle"] += 1
        elif "reference" in row:
            if not isinstance(row["reference"], str):
                raise DataError(f"{where}: 'reference' must be a string")
            to_generate.append(i)
            out[i] = base | {"reference": row["reference"], "source": "reference"}
            forms["reference"] += 1
        elif "small_score" in row and "large_score" in row:
            for k in ("small_score", "large_score"):
                if isinstance(row[k], bool) or not isinstance(row[k], (int, float)):
                    raise DataError(f"{where}: {k!r} must be a number")
            out[i] = base | {"small_score": float(row["small_score"]), "large_score": float(row["large_score"]),
                             "source": "judge"}
            forms["judge"] += 1
        else:
            raise DataError(f"{where}: needs a 'reference', judge scores ('small_score' + 'large_score') or a "
                            f"battle ('model_a', 'model_b', 'winner')")
    if to_generate:
        if not small or not large:
            raise DataError(f"{len(to_generate)} lines have a reference answer: give --small and --large engines")
        if metric == "command" and not score_cmd:
            raise DataError("--metric command needs --score-command")
        prompts = [out[i]["messages"] if "messages" in out[i] else out[i]["prompt"] for i in to_generate]
        answers = {}
        for role, folder in (("small", small), ("large", large)):
            t = time.perf_counter()
            answers[role] = generate(folder, prompts, max_tokens, list(stop), role == "small", **engine_options)
            log(f"{role} ({folder}) answered {len(prompts)} prompts in {time.perf_counter() - t:.1f}s")
        for role in ("small", "large"):
            texts = answers[role][0]
            refs = [out[i]["reference"] for i in to_generate]
            if metric == "command":
                scores = score_command(score_cmd, [{"prompt": p, "reference": r, "answer": a}
                                                   for p, r, a in zip(prompts, refs, texts)])
            for j, i in enumerate(to_generate):
                row = out[i]
                row[f"{role}_answer"] = texts[j]
                row[f"{role}_exact"] = exact_match(texts[j], refs[j])
                row[f"{role}_edit"] = round(edit_similarity(texts[j], refs[j]), 4)
                row[f"{role}_score"] = scores[j] if metric == "command" else row[f"{role}_{metric}"]
        for j, i in enumerate(to_generate):
            out[i]["small_answer_stats"] = answers["small"][1][j]
    kept = [r for r in out if r is not None]
    if not kept:
        raise DataError(f"{data}: no usable lines ({skipped} battles between other models)")
    sides: dict[str, list[dict]] = {"train": [], "test": []}
    for r in kept:
        key = r.get("group") or json.dumps(r.get("prompt", r.get("messages")), sort_keys=True)
        sides[_side(key, test_fraction)].append(r)
    out_dir.mkdir(parents=True, exist_ok=True)
    for side, items in sides.items():
        write_examples(out_dir / f"{side}.jsonl", items)
    summary = {"data": str(data), "small": small, "large": large, "small_name": small_name,
               "large_name": large_name, "metric": metric, "forms": forms, "skipped_battles": skipped,
               "train": len(sides["train"]), "test": len(sides["test"]), "test_fraction": test_fraction,
               "seconds": round(time.perf_counter() - t0, 1)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"wrote {summary['train']} train / {summary['test']} test rows to {out_dir} (forms {forms}, "
        f"{skipped} battles skipped)")
    return summary


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tandem router label --data", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--data", required=True, help="your prompts (JSONL; see the forms below)")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--small", default=None, help="small engine: a checkpoint folder (needed for reference lines)")
    p.add_argument("--large", default=None, help="large engine: a checkpoint folder")
    p.add_argument("--metric", choices=("exact", "edit", "command"), default="exact")
    p.add_argument("--score-command", default=None, help="with --metric command: your scorer (see above)")
    p.add_argument("--small-name", default=None, help="the small model's name in battles (default: folder name)")
    p.add_argument("--large-name", default=None, help="the large model's name in battles")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stop", nargs="*", default=[], help="stop strings for the answers (e.g. a newline)")
    p.add_argument("--test-fraction", type=float, default=0.3)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    try:
        build(Path(args.data), Path(args.out_dir), small=args.small, large=args.large, metric=args.metric,
              score_cmd=args.score_command, small_name=args.small_name, large_name=args.large_name,
              max_tokens=args.max_tokens, stop=tuple(s.encode().decode("unicode_escape") for s in args.stop),
              test_fraction=args.test_fraction, dtype=args.dtype)
    except (DataError, OSError, ValueError) as e:
        print(f"tandem router label: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
