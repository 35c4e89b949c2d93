"""Embeddings from a generative model's last hidden state (after the final norm): mean over the prompt's tokens
or its last token, L2-normalised. Served, an embedding is a prefill-only request in the engine's one step loop
(`InputProcessor.process_embedding`), batched with chat and completions; `pool_step` pools its rows of each
step's hidden states. `embed` is the same vectors from one varlen forward outside any engine (offline use and
the tests' reference).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engines.attention import attend_masked, needs_mask

if TYPE_CHECKING:
    from engines.errors import EngineError
    from engines.sequence import Sequence

POOLING = ("mean", "last")
MAX_PENDING = 1024  # inputs queued or running in one engine at once: beyond it EmbeddingBusy (a 503)


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


class EmbeddingFailed(RuntimeError):
    """The engine failed an embedding request (`error`: its EngineError, with its typed code)."""

    def __init__(self, error: EngineError):
        super().__init__(error.message)
        self.error = error


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


def pool_step(hidden: torch.Tensor, spans: list[tuple[Sequence, int, int, int]]) -> None:
    """Pool this step's rows of each embedding request (`StepBatch.pool_spans`: sequence, first row, rows,
    first position): mean pooling sums its rows in float32 chunk by chunk (a chunk from position 0 starts the
    sum again: a preempted request is recomputed whole), and once the prompt's last token is in, the mean or
    that token's row becomes `seq.embedding`, normalised, on the host."""
    for seq, row, n, first in spans:
        rows = hidden[row:row + n]
        last = first + n == seq.num_tokens
        if seq.pooling == "mean":
            part = rows.float().sum(0)  # every row is computed: mean pooling never takes a prefix-cache hit
            seq.pool_sum = part if first == 0 else seq.pool_sum + part
            if last:
                vector = seq.pool_sum / seq.num_tokens
        elif last:
            vector = rows[-1].float()
        if last:
            seq.embedding = torch.nn.functional.normalize(vector, dim=-1).cpu()
            seq.pool_sum = None
