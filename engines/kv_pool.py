"""The shared paged KV pool: one byte allocation carved into equal pages that every model draws from.

A page holds one block (`block_size` tokens) of K and V for all layers of one model. Pages are refcounted;
full blocks carry a chained hash so a later prompt with the same prefix reuses them (prefix caching), and
freed hashed pages wait in an LRU free list until a new allocation evicts them. A page of an int8 KV cache
carries its per token-head float32 scales after the data; an fp8 cache has one scale per layer and K/V.
"""

from __future__ import annotations

import mmap
from collections import OrderedDict
from dataclasses import dataclass

import torch


def _zeros(nbytes: int, device: torch.device) -> torch.Tensor:
    """A zeroed uint8 buffer; on the CPU from anonymous memory the kernel zeroes page by page at first touch
    (torch.zeros writes every byte up front: ~1 s of start-up for a 1 GiB pool)."""
    if device.type != "cpu" or nbytes < mmap.PAGESIZE:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)  # the tensor keeps the mapping alive

@dataclass(frozen=True)
class KVGeometry:
    """What one model needs from a page: `block_size` tokens of K and V for every layer.

    `dtype` is the storage dtype: a float dtype, torch.int8 (quantised per token and head: the page also
    holds float32 scales [2, layers, block, kv_heads] after the data) or torch.float8_e4m3fn (per-tensor
    scales, one per layer and K/V, outside the pages)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def data_bytes(self, block_size: int) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem

    def scale_bytes(self, block_size: int) -> int:
        return 2 * self.num_layers * block_size * self.num_kv_heads * 4 if self.dtype == torch.int8 else 0

    def page_bytes(self, block_size: int) -> int:
        return -(-self.data_bytes(block_size) // 4) * 4 + self.scale_bytes(block_size)


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
    def match_prefix(self, model_id: int, token_ids: list[int], extra_keys: tuple = ()
                     ) -> tuple[list[int], list[int]]:
        """Cached pages for the longest run of full blocks of `token_ids`, capped so at least one token is
        left to compute. Returns (pages, their hashes); takes no reference (call `acquire`)."""
        pages: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return pages, hashes
        bs = self.block_size
        parent: int | None = None
        for i in range((len(token_ids) - 1) // bs):
            key = (model_id, parent, tuple(token_ids[i * bs:(i + 1) * bs]), extra_keys)
            page = self._cached.get(key)
            if page is None:
                break
            parent = hash(key)
            pages.append(page)
            hashes.append(parent)
        return pages, hashes

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def commit_block(self, model_id: int, page: int, parent_hash: int | None, tokens: tuple[int, ...],
                     extra_keys: tuple = ()) -> int:
        """Register a full, computed block under its chained hash; returns the hash for the next block."""
        key = (model_id, parent_hash, tokens, extra_keys)
        h = hash(key)
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
        for i in range(len(hashes), num_full):
            parent = self.commit_block(model_id, holder.pages[i], parent, tuple(holder.token_ids[i * bs:(i + 1) * bs]),
                                       extra_keys)
            hashes.append(parent)

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
            # another model's bytes could read as NaN in this model's dtype: clear them once
            self.buffer.view(self.num_pages, self.page_bytes)[foreign] = 0
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
