"""Weights on transparent huge pages: CPU tensors the decoder streams every step, allocated in anonymous memory
advised MADV_HUGEPAGE, so a pass over them walks 2 MiB pages instead of 4 KiB ones (fewer TLB misses, and the
hardware prefetchers are not stopped at every 4 KiB).

Linux's default THP mode on many distributions is `madvise`: memory gets huge pages only where a process asks,
and torch's CPU allocator does not ask. On a 2-core Zen 4 VM (kernel 6.18, mode madvise) a one-row pass over
463 MB of float32 weights took 21.2 ms from torch's allocation and 19.8 ms from advised memory (alternated), a
plain `torch.sum` over them 29.0 -> 33.9 GB/s (bench/vs_llamacpp.py measures its streaming reference the same
way). Where THP is off (`never`), the system is not Linux, or `TANDEM_HUGEPAGES=0`, `empty` returns torch's
ordinary allocation; the values are the same either way.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
from pathlib import Path

import torch

HUGE = 2 << 20  # bytes of an x86-64 / arm64 (4 KiB base) transparent huge page
MIN_BYTES = HUGE  # smaller tensors stay in torch's allocation (a huge page would be mostly waste)
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


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, on huge pages where `enabled()` and it is at least MIN_BYTES
    (the tensor keeps its mapping alive); else `torch.empty`."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES or not enabled():
        return torch.empty(shape, dtype=dtype)
    # room to start on a huge-page boundary (address space only: pages never touched take no memory)
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(m)
    base = ctypes.addressof(view)
    del view  # (an exported buffer would pin the mapping's size, nothing else)
    off = (-base) % HUGE
    # whole huge pages only: the tail past the last one stays on base pages, so no tensor holds more memory
    # than torch's allocation would
    if not _madvise(base + off, nbytes // HUGE * HUGE):  # refused: ordinary pages, as torch's would be
        off = 0
    flat = torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=off)  # holds `m`
    return flat.view(dtype).view(shape)


def copy(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values as a contiguous tensor from `empty` (on huge pages where that applies)."""
    if t.nbytes < MIN_BYTES or not enabled():
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
