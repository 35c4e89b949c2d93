"""Embeddings from a generative model's last hidden state (after the final norm): mean over the prompt's tokens
or its last token, L2-normalised. One varlen forward embeds a whole batch (no KV cache); `embed_async` runs
it beside the engine's step loop on one thread per device, batching whatever requests wait together, and
refuses past `MAX_PENDING` waiting inputs (`EmbeddingBusy`) so the event loop never waits on torch.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from engines.attention import attend_masked, needs_mask

POOLING = ("mean", "last")
MAX_PENDING = 1024  # inputs queued or running at once (all engines of a device): beyond it EmbeddingBusy
MAX_BATCH_TOKENS = 8192  # tokens in one forward; a longer queue is embedded in several


class VarlenCausal:
    """The attention of an embedding forward: several sequences concatenated, each attending causally to itself,
    no KV kept (nothing is decoded after it)."""

    def __init__(self, seq_lens: list[int]):
        self.seq_lens = list(seq_lens)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        outs, start = [], 0
        masked = needs_mask(window, softcap, max(self.seq_lens, default=0))  # a sliding window or soft-cap
        for n in self.seq_lens:
            sl = slice(start, start + n)
            if masked:
                outs.append(attend_masked(q[sl], k[sl], v[sl], 0, window=window, softcap=softcap))
            else:  # [n, heads, dim] -> [heads, n, dim]; grouped KV heads shared by their queries
                qs, ks, vs = (t[sl].transpose(0, 1) for t in (q, k, v))
                out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                outs.append(out.transpose(0, 1))
            start += n
        return torch.cat(outs, dim=0)


class EmbeddingBusy(RuntimeError):
    """Too many inputs are waiting to be embedded: retry later."""


def embed(model: Any, inputs: list[list[int]], pooling: str = "mean") -> torch.Tensor:
    """[len(inputs), hidden] float32 unit vectors: each input's final hidden states pooled (`mean` over its
    tokens, or its `last` token), in one forward of the inputs concatenated (each attends to itself only)."""
    if pooling not in POOLING:
        raise ValueError(f"pooling={pooling!r} is invalid: use one of {', '.join(POOLING)}")
    if not inputs or any(not ids for ids in inputs):
        raise ValueError("every input needs at least one token")
    device = next(model.parameters()).device
    lens = [len(ids) for ids in inputs]
    with torch.inference_mode():
        ids = torch.tensor([t for one in inputs for t in one], dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lens])
        hidden = model.forward(ids, positions, VarlenCausal(lens)).float()  # [total tokens, hidden]
        pieces = hidden.split(lens)
        pooled = torch.stack([p.mean(0) if pooling == "mean" else p[-1] for p in pieces])
        return torch.nn.functional.normalize(pooled, dim=-1).cpu()


class _Batcher:
    """One device's queue of embedding requests: the worker thread takes every request waiting (up to
    MAX_BATCH_TOKENS) and embeds them in one forward per model and pooling."""

    def __init__(self, name: str):
        self._queue: list[tuple[Any, list[list[int]], str, Future]] = []
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tandem-embedding-{name}")
        self.pending = 0

    def submit(self, model: Any, inputs: list[list[int]], pooling: str) -> Future:
        done: Future = Future()
        with self._lock:
            if self.pending + len(inputs) > MAX_PENDING:
                raise EmbeddingBusy(f"{self.pending} inputs are already waiting to be embedded; retry shortly")
            self.pending += len(inputs)
            self._queue.append((model, inputs, pooling, done))
        self._worker.submit(self._drain)
        return done

    def _take(self) -> list[tuple[Any, list[list[int]], str, Future]]:
        with self._lock:
            if not self._queue:
                return []
            first = self._queue[0]
            batch, tokens = [], 0
            for item in list(self._queue):
                size = sum(len(ids) for ids in item[1])
                if item[0] is not first[0] or item[2] != first[2] or (batch and tokens + size > MAX_BATCH_TOKENS):
                    continue
                batch.append(item)
                tokens += size
                self._queue.remove(item)
            return batch

    def _drain(self) -> None:
        batch = self._take()  # one submit, one drain: a drain that finds the queue empty returns at once
        if not batch:
            return
        model, pooling = batch[0][0], batch[0][2]
        try:
            vectors = embed(model, [ids for item in batch for ids in item[1]], pooling)
            start = 0
            for _, inputs, _, done in batch:
                done.set_result(vectors[start:start + len(inputs)])
                start += len(inputs)
        except Exception as exc:  # a failure fails these requests, not the thread
            for *_, done in batch:
                done.set_exception(exc)
        finally:
            with self._lock:
                self.pending -= sum(len(item[1]) for item in batch)


_batchers: dict[str, _Batcher] = {}
_batchers_lock = threading.Lock()


async def embed_async(model: Any, inputs: list[list[int]], pooling: str = "mean") -> torch.Tensor:
    """`embed` on the device's embedding thread, batched with the requests waiting beside it; raises
    EmbeddingBusy past MAX_PENDING waiting inputs."""
    key = str(next(model.parameters()).device)
    with _batchers_lock:
        batcher = _batchers.get(key) or _batchers.setdefault(key, _Batcher(key))
    return await asyncio.wrap_future(batcher.submit(model, inputs, pooling))
