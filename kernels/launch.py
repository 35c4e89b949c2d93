"""Launching Triton kernels on CUDA tensors (compiled) or CPU tensors (the Triton interpreter).

`triton.jit` decides compiled-vs-interpreted once, from TRITON_INTERPRET at decoration time, so a kernel
module imported before that variable was set could never run on CPU tensors. `kernel` keeps the plain
function and builds both forms lazily; the launch picks one from the device of the tensors it is given.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

try:  # triton is absent on some CPU-only installs; the references still work there
    import triton
    import triton.language as tl  # noqa: F401  (re-exported for kernel modules)
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - the pinned environment has triton
    triton = None
    HAVE_TRITON = False


class Kernel:
    """A Triton kernel usable as `k[grid](*args, on_cuda=True/False, **constexprs)`."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.__name__ = fn.__name__
        self._compiled = None
        self._interpreted = None

    def compiled(self):
        if self._compiled is None:
            self._compiled = JITFunction(self.fn)
        return self._compiled

    def interpreted(self):
        if self._interpreted is None:
            self._interpreted = InterpretedFunction(self.fn)
        return self._interpreted

    def __getitem__(self, grid):
        def launch(*args, on_cuda: bool, **kwargs):
            if on_cuda:
                return self.compiled()[grid](*args, **kwargs)
            with _interpreted_stdlib():
                return self.interpreted()[grid](*args, **kwargs)
        return launch


_STDLIB_LOCK = threading.RLock()
_INTERPRETED: dict[int, Any] = {}


@contextlib.contextmanager
def _interpreted_stdlib() -> Iterator[None]:
    """Swap triton.language's own @jit helpers (tl.max, tl.sum, tl.cdiv, ...) for interpreted twins.

    They were decorated when triton was imported; without TRITON_INTERPRET at that moment they are compiled
    JITFunctions, which the interpreter cannot call. The swap lasts for one interpreted launch.
    """
    swapped = []
    with contextlib.suppress(ImportError):
        # imported lazily by the launcher; it insists on seeing the compiled helpers, so load it first
        import triton.experimental.gluon  # noqa: F401
    with _STDLIB_LOCK:
        try:
            for name, mod in list(sys.modules.items()):
                if mod is None or not name.startswith("triton.language"):
                    continue
                for attr, value in list(vars(mod).items()):
                    if isinstance(value, JITFunction):
                        twin = _INTERPRETED.get(id(value))
                        if twin is None:
                            twin = _INTERPRETED[id(value)] = (value, InterpretedFunction(value.fn))
                        setattr(mod, attr, twin[1])
                        swapped.append((mod, attr, value))
            yield
        finally:
            for mod, attr, value in swapped:
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
    """`tl.dot` input precision: exact fp32 in the interpreter, tf32 for fp32 on the GPU, default otherwise."""
    if not on_cuda:
        return "ieee"
    return "tf32" if dtype == torch.float32 else None
