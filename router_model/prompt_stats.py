"""What the small model makes of a prompt, as router extras: one prefill of the prompt under the small engine
(engines.scoring.prompt_profile: each token's logprob and each position's next-token entropy) summarised into
the named `PROMPT_EXTRAS`, the same function at training, adaptation and serving time, cached on disk offline.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from router_model.features import PROMPT_EXTRAS, TAIL  # defined beside the other features


def needs_prompt_stats(extras: Sequence[str]) -> bool:
    return any(e in PROMPT_EXTRAS for e in extras)


def summarize(chosen: Sequence[float], entropy: Sequence[float]) -> dict[str, float]:
    """The PROMPT_EXTRAS of one prompt from engines.scoring.prompt_profile's two lists (a one-token prompt has
    no token logprob: those stats are 0, as for a token the model was sure of)."""
    tail = chosen[-TAIL:]
    return {
        "small_prompt_logprob": math.fsum(chosen) / len(chosen) if chosen else 0.0,
        "small_prompt_min_logprob": min(chosen) if chosen else 0.0,
        "small_prompt_tail_logprob": math.fsum(tail) / len(tail) if tail else 0.0,
        "small_prompt_last_logprob": chosen[-1] if chosen else 0.0,
        "small_prompt_tail_entropy": math.fsum(entropy[-TAIL - 1:-1]) / len(entropy[-TAIL - 1:-1])
        if len(entropy) > 1 else 0.0,
        "small_next_entropy": entropy[-1] if entropy else 0.0,
    }


def prompt_stats(model: Any, token_ids: list[int]) -> dict[str, float]:
    from engines.scoring import prompt_profile

    return summarize(*prompt_profile(model, token_ids))


class PromptStats:
    """The small model's prompt statistics for many prompts offline (text, or messages through the checkpoint's
    chat template, tokenized as the engine does), cached in a JSONL keyed by prompt and model."""

    def __init__(self, model_dir: str | Path, cache: str | Path | None = None, **engine_options: Any):
        self.model_dir = str(model_dir)
        self.cache = Path(cache) if cache else None
        self.engine_options = engine_options
        self._llm = None

    def _key(self, prompt: Any) -> str:
        doc = json.dumps([prompt, Path(self.model_dir).name, TAIL], sort_keys=True)
        return hashlib.sha256(doc.encode()).hexdigest()[:32]

    def __call__(self, prompts: Sequence[Any], log=print) -> list[dict[str, float]]:
        keys = [self._key(p) for p in prompts]
        known: dict[str, dict] = {}
        if self.cache is not None and self.cache.is_file():
            with self.cache.open(encoding="utf-8") as f:
                known = {r["key"]: r["stats"] for r in map(json.loads, filter(str.strip, f))}
        todo = sorted({k: i for i, k in enumerate(keys) if k not in known}.values())
        if todo:
            from router_model.user_labels import labelling_engine

            llm, texts = labelling_engine(self.model_dir, [prompts[i] for i in todo], **self.engine_options)
            model, tok = llm.engine.model, llm.tokenizer
            t0 = time.perf_counter()
            fresh = []
            for n, (i, text) in enumerate(zip(todo, texts), 1):
                known[keys[i]] = {k: round(v, 5) for k, v in prompt_stats(model, tok.encode(text)).items()}
                fresh.append({"key": keys[i], "stats": known[keys[i]]})
                if n % 1000 == 0 or n == len(todo):
                    log(f"  prompt stats ({Path(self.model_dir).name}): {n}/{len(todo)} "
                        f"({time.perf_counter() - t0:.0f}s)")
            if self.cache is not None:
                self.cache.parent.mkdir(parents=True, exist_ok=True)
                with self.cache.open("a", encoding="utf-8") as f:
                    f.writelines(json.dumps(r) + "\n" for r in fresh)
        return [known[k] for k in keys]
