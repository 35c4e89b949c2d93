"""The shared paged KV pool: one byte allocation carved into equal pages that every model draws from.

A page holds one block (`block_size` tokens) of K and V for the layers of one model's page group (all layers,
or one group of a model with sliding windows, engines/kv_layout.py: a holder then has one page per group and
block, and a window group's pages the window has passed go back early). Pages are refcounted; full blocks
carry a chained hash so a later prompt with the same prefix reuses them (prefix caching), and freed hashed
pages wait in an LRU free list until a new allocation evicts them. A page of an int8 KV cache carries its per
token-head float32 scales after the data; an fp8 cache has one scale per layer and K/V.
"""

from __future__ import annotations

import mmap
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from engines.kv_layout import KVLayout, blocks_outside
from kernels import hugepages


def _zeros(nbytes: int, device: torch.device) -> torch.Tensor:
    """A zeroed uint8 buffer; on the CPU from anonymous memory the kernel zeroes page by page at first touch
    (torch.zeros writes every byte up front: ~1 s of start-up for a 1 GiB pool), on huge pages where the system
    gives them (kernels.hugepages.zeros)."""
    if device.type != "cpu" or nbytes < mmap.PAGESIZE:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return hugepages.zeros(nbytes)

@dataclass(frozen=True)
class KVGeometry:
    """What one model needs from a page: `block_size` tokens of K and V for every layer.

    `dtype` is the storage dtype: a float dtype, torch.int8 (quantised per token and head: the page also
    holds float32 scales [2, layers, block, kv_heads] after the data) or torch.float8_e4m3fn (per-tensor
    scales, one per layer and K/V, outside the pages)."""

    num_layers: int  # layers per page: all of the model's, or one page group's
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    # which page group and slot holds each model layer (engines/kv_layout.py); None: one group of all layers
    layout: KVLayout | None = None

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        """Each page group's window (group 0: global)."""
        return self.layout.group_windows if self.layout is not None else (None,)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def data_bytes(self, block_size: int) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem

    def scale_bytes(self, block_size: int) -> int:
        return 2 * self.num_layers * block_size * self.num_kv_heads * 4 if self.dtype == torch.int8 else 0

    def page_bytes(self, block_size: int) -> int:
        return -(-self.data_bytes(block_size) // 4) * 4 + self.scale_bytes(block_size)


@dataclass
class PrefixHit:
    """Cached pages for the first `num_blocks` blocks of a prompt: group 0's, each window group's (-1 where
    its window no longer reaches from the end of the hit: those pages are not needed) and the chained hashes."""
    pages: list[int]
    hashes: list[int]
    group_pages: list[list[int]] = field(default_factory=list)
    # `match(.., whole=True)` of a prompt that ends on a block boundary with every block cached: the last block's
    # page. `pages` then stops one block short; the caller copies this page into one of its own (`copy_page`)
    # and computes only the prompt's last token (its logits), not the whole block again.
    last: int = -1

    @property
    def num_blocks(self) -> int:
        return len(self.pages)

    def held(self) -> list[int]:
        return self.pages + [p for g in self.group_pages for p in g if p >= 0]


class KVPool:
    """Pages of one allocation, shared by several models (`model_id` = index into `geometries`).

    page_bytes is the largest model's need (rounded to 64 bytes); a smaller model leaves the tail of each of
    its pages unused, a waste reported by `page_utilization(model_id)`.
    """

    def __init__(self, geometries: list[KVGeometry], memory_bytes: int, block_size: int = 16,
                 device: torch.device | str = "cpu", enable_prefix_caching: bool = True):
        if not geometries:
            raise ValueError("KVPool needs at least one model geometry")
        self.block_size = block_size
        self.geometries = list(geometries)
        self.enable_prefix_caching = enable_prefix_caching
        need = max(g.page_bytes(block_size) for g in geometries)
        self.page_bytes = (need + 63) // 64 * 64
        self.num_pages = int(memory_bytes // self.page_bytes)
        if self.num_pages < 1:
            raise ValueError(f"KV pool of {memory_bytes} bytes holds no page of {self.page_bytes} bytes; "
                             "raise PoolSpec.memory_bytes or lower block_size")
        # zeros: a masked-out slot must never hold NaN bits (0 * NaN poisons attention in the reference path)
        self.buffer = _zeros(self.num_pages * self.page_bytes, torch.device(device))
        self._views = [self._make_view(g) for g in self.geometries]
        self._reads = [g.page_bytes(block_size) for g in self.geometries]  # bytes of a page each model reads
        self._scales = [self._make_scales(g) for g in self.geometries]
        self.ref_count = [0] * self.num_pages
        self.page_hash: list[int | None] = [None] * self.num_pages
        self.owner: list[int] = [-1] * self.num_pages
        # key (model_id, parent_hash, tokens, extra) -> page; the full key makes a hash collision harmless
        self._cached: dict[tuple, int] = {}
        self._page_key: list[tuple | None] = [None] * self.num_pages
        # LRU free list: allocation pops from the front; unhashed pages go to the front, hashed ones to the back
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(self.num_pages))
        self._num_cached_free = 0  # free pages that still carry a hash (a counter: stats() may run on any thread)
        self.prefix_queries = 0
        self.prefix_hits = 0

    def _make_view(self, g: KVGeometry) -> torch.Tensor:
        elem = torch.empty((), dtype=g.dtype).element_size()
        flat = self.buffer.view(g.dtype)
        page_elems = self.page_bytes // elem
        bs, h, d = self.block_size, g.num_kv_heads, g.head_dim
        return torch.as_strided(flat, (self.num_pages, 2, g.num_layers, bs, h, d),
                                (page_elems, g.num_layers * bs * h * d, bs * h * d, h * d, d, 1))

    def _make_scales(self, g: KVGeometry) -> torch.Tensor | None:
        if g.dtype == torch.float8_e4m3fn:
            # no calibration data at load: scale 1.0 stores K/V as they are (e4m3 covers +-448)
            return torch.ones(2, g.num_layers, dtype=torch.float32, device=self.buffer.device)
        if g.dtype != torch.int8:
            return None
        flat = self.buffer.view(torch.float32)
        bs, h = self.block_size, g.num_kv_heads
        return torch.as_strided(flat, (self.num_pages, 2, g.num_layers, bs, h),
                                (self.page_bytes // 4, g.num_layers * bs * h, bs * h, h, 1),
                                -(-g.data_bytes(bs) // 4))

    def view(self, model_id: int) -> torch.Tensor:
        """[num_pages, 2 (K, V), layers, block_size, kv_heads, head_dim] over the pool, in the storage dtype."""
        return self._views[model_id]

    def scales(self, model_id: int) -> torch.Tensor | None:
        """The KV dequantisation scales: int8 [num_pages, 2, layers, block_size, kv_heads] float32 inside the
        pages; fp8 [2, layers] float32 (per tensor); None for a float cache."""
        return self._scales[model_id]

    def page_utilization(self, model_id: int) -> float:
        return self.geometries[model_id].page_bytes(self.block_size) / self.page_bytes

    # ---- accounting -------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages an allocation can take now (truly free plus cached-but-unreferenced)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def num_cached_free(self) -> int:
        return self._num_cached_free

    def stats(self) -> dict:
        return {"num_pages": self.num_pages, "page_bytes": self.page_bytes, "used_pages": self.num_used,
                "cached_pages": self.num_cached_free, "free_pages": self.num_free,
                "kv_usage": self.num_used / self.num_pages,
                "prefix_cache_queries": self.prefix_queries, "prefix_cache_hits": self.prefix_hits}

    # ---- prefix cache -----------------------------------------------------------------------------------
    def match_prefix(self, model_id: int, token_ids: list[int], extra_keys: tuple = (), *, whole: bool = False
                     ) -> tuple[list[int], list[int]]:
        """Cached pages for the longest run of full blocks of `token_ids`, capped so at least one token is
        left to compute (`whole`: every full block). Returns (pages, their hashes); takes no reference (call
        `acquire`)."""
        pages: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return pages, hashes
        bs = self.block_size
        parent: int | None = None
        for i in range((len(token_ids) if whole else len(token_ids) - 1) // bs):
            key = (model_id, parent, tuple(token_ids[i * bs:(i + 1) * bs]), extra_keys)
            page = self._cached.get(key)
            if page is None:
                break
            parent = hash(key)
            pages.append(page)
            hashes.append(parent)
        return pages, hashes

    def match(self, model_id: int, token_ids: list[int], extra_keys: tuple = (), *, whole: bool = False
              ) -> PrefixHit:
        """`match_prefix` for every page group: the longest run of blocks whose group-0 pages are cached and
        whose window groups have the pages the next token's window reaches (the exact rule: a window page
        freed and since reused is never served; older window pages are not needed).

        `whole`: where the blocks end exactly at the last token and every one is cached (one page group), the
        hit names the last block's page in `last` (see `PrefixHit`), so only the last token is computed again
        (a block-aligned prompt otherwise recomputes its whole last block for that one token's logits)."""
        windows = self.geometries[model_id].group_windows[1:]
        n = len(token_ids)
        whole = whole and not windows and n > 0 and n % self.block_size == 0
        pages, hashes = self.match_prefix(model_id, token_ids, extra_keys, whole=whole)
        if whole and len(pages) == n // self.block_size:
            return PrefixHit(pages[:-1], hashes[:-1], last=pages[-1])
        if whole:  # not every block: the capped hit (a prefix of this one)
            del pages[(n - 1) // self.block_size:], hashes[(n - 1) // self.block_size:]
        if not windows:
            return PrefixHit(pages, hashes)
        for n in range(len(pages), 0, -1):
            found = self._window_hit(model_id, token_ids, hashes, n, windows, extra_keys)
            if found is not None:
                return PrefixHit(pages[:n], hashes[:n], found)
        return PrefixHit([], [], [[] for _ in windows])

    def _window_hit(self, model_id: int, token_ids: list[int], hashes: list[int], n: int,
                    windows: tuple[int | None, ...], extra_keys: tuple) -> list[list[int]] | None:
        bs = self.block_size
        out = []
        for g, w in enumerate(windows, start=1):
            first = blocks_outside(n * bs, w, bs)
            got = [-1] * first
            for b in range(first, n):
                page = self._cached.get((model_id, hashes[b - 1] if b else None,
                                         tuple(token_ids[b * bs:(b + 1) * bs]), extra_keys, g))
                if page is None:
                    return None
                got.append(page)
            out.append(got)
        return out

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def commit_block(self, model_id: int, page: int, parent_hash: int | None, tokens: tuple[int, ...],
                     extra_keys: tuple = (), group: int = 0) -> int:
        """Register a full, computed block under its chained hash (a window group's page under the same key and
        its group); returns the hash for the next block."""
        key = (model_id, parent_hash, tokens, extra_keys)
        h = hash(key)
        if group:
            key = key + (group,)
        if self.enable_prefix_caching and self.page_hash[page] is None and key not in self._cached:
            self._cached[key] = page
            self._page_key[page] = key
            self.page_hash[page] = h
        return h

    def commit_blocks(self, model_id: int, holder, num_full: int, extra_keys: tuple = ()) -> None:
        """Hash `holder`'s first `num_full` blocks that are not hashed yet into the prefix cache (chained: each
        hash covers its parent's); `holder` has `token_ids`, `pages` and `block_hashes` (a `Sequence`, or a
        drafter's `DraftState`), and its hash list grows with them."""
        hashes = holder.block_hashes
        bs = self.block_size
        parent = hashes[-1] if hashes else None
        groups = holder.group_pages
        for i in range(len(hashes), num_full):
            tokens = tuple(holder.token_ids[i * bs:(i + 1) * bs])
            for g, pages in enumerate(groups, start=1):
                if pages[i] >= 0:
                    self.commit_block(model_id, pages[i], parent, tokens, extra_keys, g)
            parent = self.commit_block(model_id, holder.pages[i], parent, tokens, extra_keys)
            hashes.append(parent)

    # ---- a holder's pages (a `Sequence` or a `DraftState`: `pages`, `group_pages`, `num_computed`) -----------
    def grow(self, model_id: int, holder, num_blocks: int) -> None:
        """Add `num_blocks` blocks to `holder`: one page in every page group each."""
        groups = self.geometries[model_id].num_groups
        if num_blocks <= 0:
            return
        pages = self.allocate(model_id, num_blocks * groups)
        holder.pages.extend(pages[:num_blocks])
        while len(holder.group_pages) < groups - 1:
            holder.group_pages.append([])
        for g, lst in enumerate(holder.group_pages, start=1):
            lst.extend(pages[g * num_blocks:(g + 1) * num_blocks])

    def release_holder(self, holder) -> None:
        """Drop the holder's reference on all its pages (every group's)."""
        for lst in holder.group_pages:
            self.release([p for p in lst if p >= 0])
        if holder.pages:
            self.release(holder.pages)
        holder.pages = []
        holder.group_pages = []

    def free_outside_window(self, model_id: int, holder) -> int:
        """Release the window groups' pages no later query of `holder` reaches (its next query sits at
        `num_computed`, which only grows until the holder is freed); returns how many were released."""
        windows = self.geometries[model_id].group_windows[1:]
        freed = []
        for w, lst in zip(windows, holder.group_pages):
            b = min(blocks_outside(holder.num_computed, w, self.block_size), len(lst)) - 1
            while b >= 0 and lst[b] >= 0:  # freed blocks are always a prefix: stop at the first one
                freed.append(lst[b])
                lst[b] = -1
                b -= 1
        if freed:
            self.release(freed)
        return len(freed)

    def holder_pages(self, holder) -> list[int]:
        """Every page `holder` holds now."""
        return holder.pages + [p for lst in holder.group_pages for p in lst if p >= 0]

    def copy_page(self, src: int, dst: int) -> None:
        """Page `dst` gets `src`'s bytes (K, V and their scales, every layer)."""
        pages = self.buffer.view(self.num_pages, self.page_bytes)
        pages[dst] = pages[src]

    # ---- allocation -------------------------------------------------------------------------------------
    def acquire(self, pages: list[int]) -> None:
        """Take a reference on cached pages (a prefix hit); a page sitting in the free list leaves it."""
        for p in pages:
            if self.ref_count[p] == 0:
                del self._free[p]
                self._num_cached_free -= 1  # only hashed pages are ever found by match_prefix
            self.ref_count[p] += 1

    def allocate(self, model_id: int, n: int) -> list[int]:
        """Take `n` pages for `model_id`, evicting the least recently freed cached pages first-come."""
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: asked for {n} pages, {len(self._free)} free")
        pages = []
        foreign = []
        for _ in range(n):
            p, _ = self._free.popitem(last=False)
            key = self._page_key[p]
            if key is not None:  # evict: the hash dies only now that the page is reused
                self._num_cached_free -= 1
                del self._cached[key]
                self._page_key[p] = None
                self.page_hash[p] = None
            if self.owner[p] != model_id:
                foreign.append(p)
                self.owner[p] = model_id
            self.ref_count[p] = 1
            pages.append(p)
        if foreign and len(self.geometries) > 1:
            # another model's bytes could read as NaN in this model's dtype: clear the ones it reads (a page's
            # first page_bytes(model) bytes) once; whoever takes the page next clears its own part in turn
            self.buffer.view(self.num_pages, self.page_bytes)[foreign, :self._reads[model_id]] = 0
        return pages

    def release(self, pages: list[int]) -> None:
        """Drop one reference per page; pages reaching zero join the free list, tail blocks first so a
        sequence's prefix (the most shareable part) is evicted last."""
        for p in reversed(pages):
            self.ref_count[p] -= 1
            if self.ref_count[p] == 0:
                self._free[p] = None
                if self.page_hash[p] is None:
                    self._free.move_to_end(p, last=False)
                else:
                    self._num_cached_free += 1
            elif self.ref_count[p] < 0:
                raise RuntimeError(f"KV page {p} released more often than acquired")
