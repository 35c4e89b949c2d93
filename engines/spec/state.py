"""`DraftState`: the drafter's view of one sequence, shaped like a `Sequence` for a runner."""

from __future__ import annotations

import torch


class DraftState:
    """The drafter's view of one sequence, shaped like a `Sequence` for the runner: its own token list
    (a prefix of the sequence's, then this step's drafts) and its own pages in the small model's geometry."""

    __slots__ = ("token_ids", "pages", "group_pages", "num_computed", "block_hashes", "shadow", "shadow_len")
    pooling = None  # never an embedding request (the runner's layout asks every sequence)

    def __init__(self, token_ids: list[int], pages: list[int], num_computed: int, block_hashes: list[int],
                 group_pages: list[list[int]] | None = None):
        self.token_ids = token_ids
        self.pages = pages
        self.group_pages = group_pages if group_pages is not None else []  # as `Sequence.group_pages`
        self.num_computed = num_computed
        self.block_hashes = block_hashes
        # the dense draft path's K/V copy (LeanDraftRunner._shadow) and how many positions of it
        # hold this state's current tokens; the batched paths write only the pages, so they lower it
        self.shadow: list[torch.Tensor] | None = None
        self.shadow_len = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
