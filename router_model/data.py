"""Labelled router data: one JSONL line per prompt, read into `RouterExample`s with clear errors per line.

A line has `prompt` (string) or `messages` (OpenAI-style), and either `small_score` + `large_score` (quality of
each model's answer; higher is better) or a binary `label` (1 = the large model is needed). Optional: `group`
(prompts sharing a group never straddle a train/test or cross-validation split), `extras` (named features),
and for the cascade's escalation scorer `small_answer` (the small model's answer text) with
`small_answer_stats` (its logprob statistics, router_model.scoring.answer_stats; read as extras). A file whose
name ends in .gz is read through gzip.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router_model.features import Conversation


class DataError(ValueError):
    """A labelled-data file that cannot be used; the message names the file, the line and the fix."""


@dataclass
class RouterExample:
    conversation: Conversation
    small_score: float | None = None
    large_score: float | None = None
    label: int | None = None
    group: str | None = None
    extras: dict[str, float] = field(default_factory=dict)
    answer: str | None = None  # the small model's answer (escalation scorer only)

    @property
    def has_scores(self) -> bool:
        return self.small_score is not None and self.large_score is not None

    def qualities(self) -> tuple[float, float]:
        """(small, large) quality; a binary label reads as small 0 / large 1 when needed, else both 1."""
        if self.has_scores:
            return float(self.small_score), float(self.large_score)  # type: ignore[arg-type]
        if self.label is None:
            raise DataError("example has neither small_score/large_score nor label")
        return (0.0, 1.0) if self.label else (1.0, 1.0)

    def large_needed(self, margin: float) -> int:
        """The training target: the large model's answer is better by more than `margin` (or the label)."""
        if self.has_scores:
            return int(self.large_score - self.small_score > margin)  # type: ignore[operator]
        if self.label is None:
            raise DataError("example has neither small_score/large_score nor label")
        return int(self.label)


def _number(value: Any, where: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{where}: {key!r} must be a finite number, got {value!r}")
    return float(value)


def parse_example(obj: Any, where: str) -> RouterExample:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: each line must be a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        conv = obj["messages"]
        if not isinstance(conv, list) or not conv or not all(isinstance(m, dict) for m in conv):
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    elif isinstance(obj.get("prompt"), str):
        conv = obj["prompt"]
    else:
        raise DataError(f"{where}: needs a 'prompt' string or a 'messages' list")
    ex = RouterExample(conversation=conv)
    if "small_score" in obj or "large_score" in obj:
        if "small_score" not in obj or "large_score" not in obj:
            raise DataError(f"{where}: give both 'small_score' and 'large_score' (or a binary 'label')")
        ex.small_score = _number(obj["small_score"], where, "small_score")
        ex.large_score = _number(obj["large_score"], where, "large_score")
    if "label" in obj:
        if obj["label"] not in (0, 1):
            raise DataError(f"{where}: 'label' must be 0 or 1 (1 = the large model is needed), got {obj['label']!r}")
        ex.label = int(obj["label"])
    if not ex.has_scores and ex.label is None:
        raise DataError(f"{where}: needs 'small_score' and 'large_score', or a binary 'label'")
    if obj.get("group") is not None:
        ex.group = str(obj["group"])
    extras = obj.get("extras") or {}
    if not isinstance(extras, dict):
        raise DataError(f"{where}: 'extras' must be an object of name -> number")
    ex.extras = {str(k): _number(v, where, f"extras.{k}") for k, v in extras.items()}
    if obj.get("small_answer") is not None:
        if not isinstance(obj["small_answer"], str):
            raise DataError(f"{where}: 'small_answer' must be a string")
        ex.answer = obj["small_answer"]
    stats = obj.get("small_answer_stats") or {}
    if not isinstance(stats, dict):
        raise DataError(f"{where}: 'small_answer_stats' must be an object of name -> number")
    ex.extras |= {str(k): _number(v, where, f"small_answer_stats.{k}") for k, v in stats.items()}
    return ex


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file (gzip when the name ends in .gz), with errors naming the line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: data file does not exist")
    rows = []
    opener = gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")
    with opener as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    if not rows:
        raise DataError(f"{path}: no examples (expected one JSON object per line)")
    return rows


def read_examples(path: str | Path) -> list[RouterExample]:
    return [parse_example(obj, f"{path}:{i}") for i, obj in enumerate(read_rows(path), 1)]


def write_examples(path: str | Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write already-built JSON rows, one per line (gzip when the name ends in .gz); returns how many."""
    n = 0
    path = Path(path)
    with (gzip.open(path, "wt", encoding="utf-8") if path.suffix == ".gz" else path.open("w", encoding="utf-8")) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n
