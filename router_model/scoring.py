"""Task-success scoring of one answer against a reference, and the statistics of an answer's own token logprobs.

`exact_match` / `edit_similarity` follow CodeXGLUE's line-level code completion: both strings are whitespace-
normalised (split on whitespace, joined by one space) first; edit similarity is difflib's ratio in [0, 1] (what
fuzzywuzzy's `fuzz.ratio` / 100 computes). `answer_stats` is shared by the labeller and the gateway's cascade,
so the learned escalation scorer sees at serve time exactly the numbers it was trained on.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Any

METRICS = ("exact", "edit")
# the statistics of the small answer the escalation scorer reads (names are the artifact's extras)
ANSWER_STATS = ("answer_mean_logprob", "answer_min_logprob", "answer_first_line_logprob", "answer_entropy",
                "answer_log_tokens")
# top logprobs per position the cascade asks the small engine for: the entropy is estimated from them
ENTROPY_TOP_K = 5


def normalize(text: str) -> str:
    return " ".join(text.split())


def exact_match(answer: str, reference: str) -> float:
    return float(normalize(answer) == normalize(reference))


def edit_similarity(answer: str, reference: str) -> float:
    a, b = normalize(answer), normalize(reference)
    if not a and not b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def agreement(small: str, large: str) -> dict[str, float]:
    """The self-label of one pair of greedy answers (the gateway's shadow runs and `tandem router adapt`): 1.0
    where the small answer matches the large one, on the first line and on the whole answer, and their edit
    similarity."""
    first = (small.split("\n", 1)[0], large.split("\n", 1)[0])
    return {"first_line_exact": exact_match(*first), "exact": exact_match(small, large),
            "edit_similarity": edit_similarity(small, large)}


def score_answer(answer: str, reference: str, metric: str) -> float:
    if metric == "exact":
        return exact_match(answer, reference)
    if metric == "edit":
        return edit_similarity(answer, reference)
    raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")


def answer_stats(token_ids: Sequence[int], logprobs: Sequence[Mapping[int, Any]] | None,
                 token_texts: Sequence[str] | None = None) -> dict[str, float]:
    """Mean / minimum chosen-token logprob, the mean over the first line's tokens, the mean entropy of the
    next-token distribution estimated from the top logprobs (the mass outside them counted as one outcome),
    and log(1 + tokens). `logprobs[i]` maps token id -> object with `.logprob` (engines.outputs.Logprob) or a
    float. An empty answer, or one without logprobs, gets the most doubtful values (-20, entropy 5)."""
    n = len(token_ids)
    chosen, entropies = [], []
    exp, log = math.exp, math.log
    for tid, pos in zip(token_ids, logprobs or ()):
        values = {int(k): float(getattr(v, "logprob", v)) for k, v in pos.items()}
        chosen.append(max(values.get(int(tid), -20.0), -20.0))
        ps = [exp(v) for v in values.values()]
        ps.append(max(0.0, 1.0 - sum(ps)))  # the mass outside the top logprobs
        entropies.append(-sum([p * log(p) for p in ps if p > 0.0]))
    if n == 0 or len(chosen) < n:
        return {"answer_mean_logprob": -20.0, "answer_min_logprob": -20.0, "answer_first_line_logprob": -20.0,
                "answer_entropy": 5.0, "answer_log_tokens": math.log1p(n)}
    first = n
    if token_texts is not None:
        for i, t in enumerate(token_texts):
            if "\n" in t and i > 0:
                first = i + 1
                break
    return {"answer_mean_logprob": sum(chosen) / n, "answer_min_logprob": min(chosen),
            "answer_first_line_logprob": sum(chosen[:first]) / first, "answer_entropy": sum(entropies) / n,
            "answer_log_tokens": math.log1p(n)}
