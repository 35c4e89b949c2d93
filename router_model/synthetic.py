"""A synthetic labelled set whose "large needed" signal is known: for tests, demos and pipeline dry runs.

Hard prompts ask for a proof or a computation with numbers (the large model wins big); easy prompts are
small talk (both models do about as well). Everything else (filler words, turn structure) is noise.
"""

from __future__ import annotations

import random
from typing import Any

_EASY = ["hello there", "thanks a lot", "what is your name", "tell me a joke", "good morning", "how are you"]
_HARD = ["prove that the integral of", "compute the determinant for", "derive the closed form of",
         "solve the recurrence with"]
_FILLER = "alpha beta gamma delta river stone cloud paper light music garden window yellow quiet".split()


def synthetic_rows(n: int, seed: int = 0, hard_fraction: float = 0.4, chat_fraction: float = 0.3,
                   groups: int = 40) -> list[dict[str, Any]]:
    """`n` JSONL-ready rows with prompt or messages, small_score, large_score, label and group."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        hard = rng.random() < hard_fraction
        filler = " ".join(rng.sample(_FILLER, 4))
        if hard:
            text = f"{rng.choice(_HARD)} {filler} {rng.randint(10, 999)} * {rng.randint(10, 999)}"
            small, large = rng.gauss(0.2, 0.1), rng.gauss(0.9, 0.1)
        else:
            text = f"{rng.choice(_EASY)}, {filler}"
            small, large = rng.gauss(0.8, 0.1), rng.gauss(0.8, 0.1)
        row: dict[str, Any] = {"small_score": small, "large_score": large, "label": int(hard),
                               "group": f"g{i % groups}"}
        if rng.random() < chat_fraction:
            row["messages"] = [{"role": "system", "content": "You are a helpful assistant."},
                               {"role": "user", "content": text}]
        else:
            row["prompt"] = text
        rows.append(row)
    return rows
