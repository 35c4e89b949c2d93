"""Which pages hold which layers: a model with global and sliding-window layers (Gemma 2/3) keeps them in
separate page groups, each with its own block table, so a window layer's pages the window has passed can go
back to the pool during decoding (vLLM's hybrid KV-cache manager does the same with its sliding-window spec).
Every group's page holds the same number of layers; a model without windows has one group of all layers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    layers_per_page: int
    layer_group: tuple[int, ...]  # per model layer: its page group
    layer_slot: tuple[int, ...]  # per model layer: its layer index inside the group's pages
    group_windows: tuple[int | None, ...]  # per group: its window in tokens, None for global; group 0 is global

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def grouped(self) -> bool:
        return self.num_groups > 1


def blocks_outside(num_computed: int, window: int | None, block_size: int) -> int:
    """Leading blocks no query at position >= num_computed reaches through `window` (it sees keys j with
    i - window < j <= i): their pages can go."""
    return 0 if window is None else max(0, (num_computed - window + 1) // block_size)


def flat_layout(num_layers: int) -> KVLayout:
    return KVLayout(num_layers, (0,) * num_layers, tuple(range(num_layers)), (None,))


def kv_layout(layer_windows: tuple[int | None, ...], num_layers: int, free_window_pages: bool = True) -> KVLayout:
    """Page groups for these per-layer windows: the global layers fill group 0 (one group, G layers per page),
    the window layers of each window size groups of G after it (the last one may be part empty). Grouped only
    where there are both kinds and no fewer window layers than global ones (Gemma 2 1:1, Gemma 3 5:1); a model
    whose layers all slide (Mistral) or mostly global ones stay flat (every layer in each page, nothing freed)."""
    windows = tuple(layer_windows) or (None,) * num_layers
    glob = [i for i, w in enumerate(windows) if w is None]
    local = [i for i, w in enumerate(windows) if w is not None]
    if not free_window_pages or not glob or len(local) < len(glob):
        return flat_layout(num_layers)
    size = len(glob)
    group, slot = [0] * num_layers, [0] * num_layers
    group_windows: list[int | None] = [None]
    for j, i in enumerate(glob):
        slot[i] = j
    for w in sorted({windows[i] for i in local}):
        members = [i for i in local if windows[i] == w]
        for start in range(0, len(members), size):
            group_windows.append(w)
            for j, i in enumerate(members[start:start + size]):
                group[i], slot[i] = len(group_windows) - 1, j
    return KVLayout(size, tuple(group), tuple(slot), tuple(group_windows))
