"""Weights on transparent huge pages: CPU tensors the decoder streams every step, allocated in anonymous memory
advised MADV_HUGEPAGE, so a pass over them walks 2 MiB pages instead of 4 KiB ones (fewer TLB misses, and the
hardware prefetchers are not stopped at every 4 KiB).

Linux's default THP mode on many distributions is `madvise`: memory gets huge pages only where a process asks,
and torch's CPU allocator does not ask. On a 2-core Zen 4 VM (kernel 6.18, mode madvise) a one-row pass over
463 MB of float32 weights took 21.2 ms from torch's allocation and 19.8 ms from advised memory (alternated), a
plain `torch.sum` over them 29.0 -> 33.9 GB/s (bench/vs_llamacpp.py measures its streaming reference the same
way). Where THP is off (`never`), the system is not Linux, or `TANDEM_HUGEPAGES=0`, `empty` returns torch's
ordinary allocation; the values are the same either way.

`empty` alone gives each tensor its own mapping: whole huge pages, the tail past the last one on base pages and
tensors under 2 MiB in torch's allocation, so no tensor holds more memory than torch's would. Inside `arena()`
(the C decoder's build, kernels/cpu_forward.py) tensors from 64 KiB up are carved one after another from shared
huge-page mappings instead: a model's weights lie on huge pages end to end, in the order the build makes them
(the order a decode pass reads them), its sub-2 MiB projections and tails included. On the Zen 4 VM a one-row
w8a8 pass over ~200M's layers read 0.69-0.70 of the streaming rate from per-tensor mappings and 0.81-0.84 from
one arena (bench/kernel_ab.py's shapes; docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

HUGE = 2 << 20  # bytes of an x86-64 / arm64 (4 KiB base) transparent huge page
MIN_BYTES = HUGE  # smaller tensors stay in torch's allocation (a huge page would be mostly waste)
ARENA_CHUNK = 64 << 20  # an arena's mappings: this many bytes, or a larger tensor's whole huge pages
ARENA_MIN = 64 << 10  # smaller tensors stay in torch's allocation inside an arena too
ARENA_ALIGN = 4096  # each carved tensor starts on a base page
MADV_HUGEPAGE = 14
_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_libc = None
_mode: str | None = None


def mode() -> str:
    """The kernel's THP mode ("always", "madvise", "never"), or "" where there is none to read."""
    global _mode
    if _mode is None:
        try:
            text = _MODE.read_text()
            _mode = text[text.index("[") + 1:text.index("]")]
        except (OSError, ValueError):
            _mode = ""
    return _mode


def enabled() -> bool:
    return (sys.platform.startswith("linux") and mode() in ("always", "madvise")
            and os.environ.get("TANDEM_HUGEPAGES", "1") != "0")


def _madvise(addr: int, length: int) -> bool:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise(addr, length, MADV_HUGEPAGE) == 0


class Arena:
    """Consecutive tensors from shared mappings advised MADV_HUGEPAGE as a whole: each `take` starts where the
    last one ended (rounded up to ARENA_ALIGN) in the current mapping, or opens a new one of ARENA_CHUNK bytes
    (or the tensor's whole huge pages, if larger). A carved tensor keeps its mapping alive, so a mapping's
    memory is freed once every tensor in it is; what a mapping's last tensor leaves untouched costs address
    space, and at most the rest of one huge page."""

    def __init__(self, chunk: int = ARENA_CHUNK):
        self.chunk = chunk
        self._lock = threading.Lock()
        self._map: mmap.mmap | None = None
        self._start = self._size = self._off = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """`nbytes` uninitialised bytes (a flat uint8 tensor) after the previous take."""
        with self._lock:
            if self._map is None or self._off + nbytes > self._size:
                size = max(self.chunk, -(-nbytes // HUGE) * HUGE)
                self._map, self._start = _huge_mapping(size, size)
                self._size, self._off = size, 0
            flat = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=self._start + self._off)
            self._off += -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN
        return flat


_active = threading.local()  # the arena `empty` carves from on this thread, if any


@contextmanager
def arena(chunk: int = ARENA_CHUNK) -> Iterator[Arena]:
    """Within it, `empty` (and so `copy`, `cat`) on this thread carves tensors of ARENA_MIN bytes and up from
    one `Arena`, end to end on huge pages; the tensors outlive the block."""
    prev = getattr(_active, "arena", None)
    _active.arena = Arena(chunk)
    try:
        yield _active.arena
    finally:
        _active.arena = prev


def _huge_mapping(size: int, advise: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping of `size` bytes from a huge-page boundary (room for it: address space only, pages never
    touched take no memory), its first `advise` bytes advised as huge pages: (the mapping, the boundary's offset
    in it; 0 where the advice was refused, the memory then ordinary pages as torch's would be)."""
    m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(m)
    base = ctypes.addressof(view)
    del view  # (an exported buffer would pin the mapping's size, nothing else)
    off = (-base) % HUGE
    return m, off if _madvise(base + off, advise) else 0


def _placed(nbytes: int) -> bool:
    """Whether `empty` places a tensor of `nbytes` itself (an arena's floor inside `arena()`, else MIN_BYTES)."""
    return enabled() and nbytes >= (ARENA_MIN if getattr(_active, "arena", None) is not None else MIN_BYTES)


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, on huge pages where `enabled()` and it is at least MIN_BYTES
    (the tensor keeps its mapping alive), or inside `arena()` at least ARENA_MIN bytes (carved from the arena);
    else `torch.empty`."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not _placed(nbytes):
        return torch.empty(shape, dtype=dtype)
    carve = getattr(_active, "arena", None)
    if carve is not None:
        return carve.take(nbytes).view(dtype).view(shape)
    # whole huge pages only: the tail past the last one stays on base pages, so no tensor holds more memory
    # than torch's allocation would
    m, off = _huge_mapping(nbytes, nbytes // HUGE * HUGE)
    flat = torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=off)  # holds `m`
    return flat.view(dtype).view(shape)


def zeros(nbytes: int) -> torch.Tensor:
    """A flat uint8 CPU tensor of `nbytes` zero bytes from its own anonymous mapping (the kernel zeroes each page at
    first touch, so untouched pages cost nothing), its whole huge pages advised MADV_HUGEPAGE where `enabled()`.
    Never carved from an `arena()`. For the paged KV cache: attention reads a KV head's rows as short pieces
    spread over the pool, and on base pages every few tokens is another TLB miss."""
    if enabled() and nbytes >= HUGE:
        m, off = _huge_mapping(nbytes, nbytes // HUGE * HUGE)
        return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=off)  # holds `m`
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)  # the tensor keeps the mapping alive


def copy(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values as a contiguous tensor from `empty` (on huge pages where that applies)."""
    if not _placed(t.nbytes):
        return t.contiguous()
    out = empty(t.shape, t.dtype)
    out.copy_(t)
    return out


def cat(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """`torch.cat(tensors, dim)` into a tensor from `empty`."""
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    out = empty(tuple(shape), tensors[0].dtype)
    return torch.cat(tensors, dim=dim, out=out)
