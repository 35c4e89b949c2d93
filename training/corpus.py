"""The training corpus of the embedded default models: the CPython standard library's own `*.py` source.

Owns the deterministic split by module path hash: `train`, `validation` and `heldout` (whole modules kept
out of training, for router labels and evaluation only). The same interpreter gives the same split anywhere.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

SPLITS = ("train", "validation", "heldout")
# buckets out of 100 by sha256 of the module's relative path: 5% held out, 3% validation, the rest train
HELDOUT_BUCKETS = range(0, 5)
VALIDATION_BUCKETS = range(5, 8)

# test suites, vendored packages and per-machine generated files are not "the library"
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "lib-dynload", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def module_name(rel_path: Path) -> str:
    """`json/decoder.py` -> `json.decoder`; a package's `__init__.py` keeps its dotted name plus `__init__`."""
    return ".".join(rel_path.with_suffix("").parts)


def split_of(name: str) -> str:
    bucket = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % 100
    if bucket in HELDOUT_BUCKETS:
        return "heldout"
    if bucket in VALIDATION_BUCKETS:
        return "validation"
    return "train"


def iter_modules(root: Path | None = None) -> list[tuple[str, Path]]:
    """Every library module as (dotted name, file), sorted by name so the order never depends on the disk."""
    root = root or stdlib_root()
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in _SKIP_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("_sysconfigdata"):
            continue
        found.append((module_name(rel), path))
    found.sort()
    return found


def load_corpus_split(split: str, root: Path | None = None) -> list[tuple[str, str]]:
    """(module_name, source text) for every module of `split` ("train" | "validation" | "heldout")."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    out = []
    for name, path in iter_modules(root):
        if split_of(name) != split:
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        if text.strip():
            out.append((name, text))
    return out
