"""The token ids a packed grammar mask allows (int32 words, one bit per token, as engines/structured.py keeps
them), for the tests that walk a grammar by its own masks."""

from __future__ import annotations

import torch


def allowed_ids(mask: torch.Tensor, vocab: int) -> list[int]:
    """The ids below `vocab` whose bit is set in `mask` [W]."""
    bits = (mask.to(torch.int64)[:, None] >> torch.arange(32)) & 1
    return [i for i in bits.flatten().nonzero().flatten().tolist() if i < vocab]
