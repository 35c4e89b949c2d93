"""Launching Triton kernels on CUDA tensors (compiled) or CPU tensors (the Triton interpreter).

`triton.jit` decides compiled-vs-interpreted once, from TRITON_INTERPRET at decoration time, so a kernel
module imported before that variable was set could never run on CPU tensors. `kernel` keeps the plain
function and builds both forms lazily; the launch picks one from the device of the tensors it is given.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

# triton is imported at a kernel's first launch, not here: a CPU server never launches one, and the import
# (~0.15-0.2 s, with its backends' entry-point scan) was a tenth of `tandem serve`'s start-up. It is absent on
# some CPU-only installs; the references still work there.
HAVE_TRITON = importlib.util.find_spec("triton") is not None


class _Language:
    """`triton.language` until it is imported: the kernel modules' `tl`. A kernel's first launch puts the real
    module in their globals (`Kernel._bind`), so what triton's compiler and interpreter see is the module."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_triton().language, name)


tl: Any = _Language()  # re-exported for kernel modules


@functools.cache
def _triton() -> Any:
    """The triton package with its language, JIT and interpreter imported (ImportError where it is absent)."""
    import triton
    import triton.language  # noqa: F401
    import triton.runtime.interpreter  # noqa: F401
    import triton.runtime.jit  # noqa: F401

    return triton


def _jit_kinds() -> tuple[type, type]:
    """(JITFunction, InterpretedFunction)."""
    triton = _triton()
    return triton.runtime.jit.JITFunction, triton.runtime.interpreter.InterpretedFunction


class Kernel:
    """A Triton kernel usable as `k[grid](*args, on_cuda=True/False, **constexprs)`."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.__name__ = fn.__name__
        self._compiled = None
        self._interpreted = None

    def _bind(self) -> None:
        """The real triton.language in the kernel's module, in place of the placeholder `tl`."""
        scope = self.fn.__globals__
        if isinstance(scope.get("tl"), _Language):
            scope["tl"] = _triton().language

    def compiled(self):
        if self._compiled is None:
            self._bind()
            self._compiled = _jit_kinds()[0](self.fn)
        return self._compiled

    def interpreted(self):
        if self._interpreted is None:
            self._bind()
            self._interpreted = _jit_kinds()[1](self.fn)
        return self._interpreted

    def __getitem__(self, grid):
        def launch(*args, on_cuda: bool, num_warps: int | None = None, num_stages: int | None = None, **kwargs):
            impl = self.compiled() if on_cuda else self.interpreted()
            if on_cuda:  # launch options exist only for compiled kernels
                kwargs.update({k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v})
            with _stdlib_as(_jit_kinds()[0] if on_cuda else _jit_kinds()[1]):
                return impl[grid](*args, **kwargs)
        return launch


_STDLIB_LOCK = threading.RLock()
_TWINS: dict[tuple[int, type], Any] = {}
_NEEDS_SWAP: dict[type, bool] = {}


def _stdlib_functions(kind: type) -> list[tuple[Any, str, Any]]:
    """(module, name, function) for triton.language's own @jit helpers that are NOT of `kind`."""
    jit, interpreted = _jit_kinds()
    other = interpreted if kind is jit else jit
    found = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("triton.language"):
            continue
        for attr, value in list(vars(mod).items()):
            if isinstance(value, other):
                found.append((mod, attr, value))
    return found


@contextlib.contextmanager
def _stdlib_as(kind: type) -> Iterator[None]:
    """Make triton.language's own @jit helpers (tl.max, tl.sum, tl.cdiv, ...) of `kind` for one launch.

    They were decorated when triton was imported, compiled or interpreted depending on TRITON_INTERPRET at
    that moment; a kernel of the other kind cannot call them. Checked once per kind; swapped only if needed.
    """
    if _NEEDS_SWAP.get(kind) is False:
        yield
        return
    with contextlib.suppress(ImportError):
        # imported lazily by the interpreter's launcher; it insists on compiled helpers, so load it first
        import triton.experimental.gluon  # noqa: F401
    with _STDLIB_LOCK:
        found = _stdlib_functions(kind)
        _NEEDS_SWAP[kind] = bool(found)
        try:
            for mod, attr, value in found:
                twin = _TWINS.get((id(value), kind))
                if twin is None:
                    twin = _TWINS[(id(value), kind)] = (value, kind(value.fn))
                setattr(mod, attr, twin[1])
            yield
        finally:
            for mod, attr, value in found:
                setattr(mod, attr, value)


def kernel(fn: Callable[..., Any]) -> Kernel:
    """Decorator replacing `@triton.jit` for entry kernels (helpers called from kernels stay inline)."""
    if not HAVE_TRITON:
        raise ImportError("triton is not installed; use the *_ref functions")
    return Kernel(fn)


def require_triton() -> None:
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed; use the *_ref reference functions on this machine")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_precision(dtype: torch.dtype, on_cuda: bool) -> str | None:
    """`tl.dot` input precision: IEEE fp32 for fp32 inputs (exact in the interpreter, tf32 would cost ~1e-3
    on the GPU; serving runs bf16/fp16 anyway), the default for 16-bit inputs."""
    if not on_cuda or dtype == torch.float32:
        return "ieee"
    return None


@functools.lru_cache(maxsize=8)
def sm_count(device_index: int = 0) -> int:
    """Streaming multiprocessors of a CUDA device (cached: launch heuristics ask at every call)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
