"""Shared test fixtures: tiny random checkpoints, each built once per test session and cached by its arguments."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # so tests can `import tiny_checkpoints`

from tiny_checkpoints import build_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_checkpoint(arch, **build_checkpoint_kwargs) -> Path`; the same arguments return the same folder.

    Callers must not modify the folder; copy it first (shutil.copytree) to make a broken variant.
    """
    cache: dict[str, Path] = {}

    def build(arch: str = "llama", **kwargs) -> Path:
        key = f"{arch}-{sorted(kwargs.items())!r}"
        if key not in cache:
            cache[key] = build_checkpoint(tmp_path_factory.mktemp(arch), arch, **kwargs)
        return cache[key]

    return build


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a loaded 2-core box they stall (~50x). Modules
    that run engines take it with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
