"""Prompt logprobs (vLLM's `prompt_logprobs`; OpenAI's `echo` with `logprobs`): the log-probability the model
gives each prompt token after the tokens before it, with its rank and the top-k alternatives. The first token
has none (nothing precedes it): None, as in vLLM.

Scoring is one dense causal forward of the prompt (`Transformer.dense_logits`, no KV cache), outside the
engine's step loop: `prompt_logprobs` is the computation (the offline `LLM` calls it in its own thread) and
`score_async` runs it for asyncio callers on one scoring thread per device, so the event loop never waits on
torch and at most `MAX_PENDING` scorings queue before a caller is told to retry (`ScoringBusy`).
`prompt_profile` is the same forward kept as plain numbers (each token's logprob, each position's next-token
entropy, the last position's included), what a router reads of the prompt (router_model/prompt_stats.py).
Logprobs are the raw model's (no temperature or penalties), as the engine's sampled-token logprobs are.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from engines.outputs import Logprob, PositionLogprobs

MAX_TOP_LOGPROBS = 20
MAX_PENDING = 256  # scorings queued or running at once (all engines): beyond it ScoringBusy
CHUNK = 512  # prompt positions whose log-softmax is taken at once (the logits are [positions, vocab])


class ScoringBusy(RuntimeError):
    """Too many prompt scorings are waiting: retry later."""


def prompt_logprobs(model: Any, token_ids: list[int], top_k: int = 0, tokenizer: Any = None
                    ) -> list[PositionLogprobs | None]:
    """One entry per prompt token: None for the first; then {token: Logprob(logprob, rank)} for the prompt's
    own token plus the `top_k` most likely tokens (ranks 1..top_k). `decoded_token` is filled when a
    tokenizer is given."""
    if not 0 <= top_k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_k={top_k} is invalid: must be between 0 and {MAX_TOP_LOGPROBS}")
    if len(token_ids) < 2:
        return [None] * len(token_ids)
    device = next(model.parameters()).device
    chosen_l: list[float] = []
    ranks_l: list[int] = []
    top_ids: list[list[int]] | None = [] if top_k else None
    top_lps: list[list[float]] | None = [] if top_k else None
    with torch.inference_mode():
        ids = torch.tensor([token_ids], dtype=torch.long, device=device)
        logits = model.dense_logits(ids)[0, :-1]  # position i predicts token i + 1
        targets = ids[0, 1:]
        for start in range(0, logits.shape[0], CHUNK):  # float32 copies of CHUNK rows at a time, not all
            logprobs = torch.log_softmax(logits[start:start + CHUNK].float(), dim=-1)
            chosen = logprobs.gather(1, targets[start:start + CHUNK, None])  # [rows, 1]
            chosen_l += chosen[:, 0].tolist()
            ranks_l += ((logprobs > chosen).sum(-1) + 1).tolist()
            if top_k:
                top = logprobs.topk(top_k, dim=-1)
                top_ids += top.indices.tolist()
                top_lps += top.values.tolist()
    text = tokenizer.token_text if tokenizer is not None else (lambda _: None)
    out: list[PositionLogprobs | None] = [None]
    for j, token in enumerate(token_ids[1:]):
        position: PositionLogprobs = {token: Logprob(chosen_l[j], ranks_l[j], text(token))}
        if top_ids is not None:
            for r, (t, lp) in enumerate(zip(top_ids[j], top_lps[j]), start=1):
                if t not in position:
                    position[t] = Logprob(lp, r, text(t))
        out.append(position)
    return out


def prompt_profile(model: Any, token_ids: list[int]) -> tuple[list[float], list[float]]:
    """(chosen, entropy): `chosen[i]` the logprob of token i + 1 after tokens 0..i (as `prompt_logprobs`), and
    `entropy[i]` the entropy (nats) of the model's next-token distribution after tokens 0..i, for every
    position including the last (what the model expects right after the prompt). One dense forward."""
    if not token_ids:
        return [], []
    device = next(model.parameters()).device
    chosen: list[float] = []
    entropy: list[float] = []
    with torch.inference_mode():
        ids = torch.tensor([token_ids], dtype=torch.long, device=device)
        logits = model.dense_logits(ids)[0]
        targets = ids[0, 1:]
        for start in range(0, logits.shape[0], CHUNK):
            logprobs = torch.log_softmax(logits[start:start + CHUNK].float(), dim=-1)
            entropy += (-(logprobs.exp() * logprobs).sum(-1)).tolist()
            rows = targets[start:start + CHUNK]  # the last position has no target
            chosen += logprobs[:rows.shape[0]].gather(1, rows[:, None])[:, 0].tolist()
    return chosen, entropy


_executors: dict[str, ThreadPoolExecutor] = {}
_lock = threading.Lock()
_pending = 0


def _executor(device: torch.device) -> ThreadPoolExecutor:
    key = str(device)
    with _lock:
        if key not in _executors:  # one thread per device: scorings run one at a time beside the engine loop
            _executors[key] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tandem-scoring-{key}")
        return _executors[key]


async def score_async(model: Any, token_ids: list[int], top_k: int = 0, tokenizer: Any = None
                      ) -> list[PositionLogprobs | None]:
    """`prompt_logprobs` on the device's scoring thread; raises ScoringBusy past MAX_PENDING waiting."""
    return await _on_scoring_thread(model, prompt_logprobs, model, token_ids, top_k, tokenizer)


async def profile_async(model: Any, token_ids: list[int]) -> tuple[list[float], list[float]]:
    """`prompt_profile` on the device's scoring thread (the same queue and bound as `score_async`)."""
    return await _on_scoring_thread(model, prompt_profile, model, token_ids)


async def _on_scoring_thread(model: Any, fn: Any, *args: Any) -> Any:
    global _pending
    with _lock:
        if _pending >= MAX_PENDING:
            raise ScoringBusy(f"{_pending} prompt scorings are already waiting; retry shortly")
        _pending += 1
    try:
        loop = asyncio.get_running_loop()
        device = next(model.parameters()).device
        return await loop.run_in_executor(_executor(device), fn, *args)
    finally:
        with _lock:
            _pending -= 1
