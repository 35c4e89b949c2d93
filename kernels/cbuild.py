"""Build a C source with the system compiler at first use and cache the shared library by a hash of what went
into it (source, flags, compiler version, any extra key such as the CPU's flags), for ctypes to load. No torch,
no headers, no ninja: one `cc` call. Used by kernels/cpu_kernels.py and router_model/native.py."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path


class NoCompiler(OSError):
    """No C compiler on PATH (`$CC`, `cc` or `gcc`)."""


def compiler() -> tuple[str, str]:
    """(the compiler, its `--version` text); raises NoCompiler."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise NoCompiler("no C compiler (cc / gcc) on PATH")
    return cc, subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout


def build_library(source: str, stem: str, flags: Sequence[str], cache: Path, key: Sequence[str] = (),
                  libs: Sequence[str] = ("-lm",)) -> Path:
    """The path of `<cache>/<stem>-<hash>.so` built from `source` with `flags` (compiled now if it is not
    there yet). Processes building at once each see a whole library (written to a temporary name, then
    renamed). Raises NoCompiler, or subprocess.CalledProcessError with the compiler's output."""
    cc, version = compiler()
    digest = hashlib.sha256("\0".join((source, " ".join(flags), version, *key)).encode()).hexdigest()[:20]
    so = cache / f"{stem}-{digest}.so"
    if so.exists():
        return so
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    src = Path(tmp).with_suffix(".c")
    try:
        src.write_text(source)
        subprocess.run([cc, *flags, "-o", tmp, str(src), *libs], check=True, capture_output=True, timeout=120)
        os.replace(tmp, so)
    finally:
        for p in (tmp, src):
            if os.path.exists(p):
                os.unlink(p)
    return so
