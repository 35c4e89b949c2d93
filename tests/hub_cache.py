"""A Hugging Face Hub cache laid out on disk as huggingface_hub itself writes it (blobs, snapshots/<sha>/ links,
refs/<branch>), so tests resolve Hub ids through the real library with HF_HUB_OFFLINE=1 and no network."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_repo(cache: Path, repo_id: str, files: dict[str, Path | bytes], sha: str | None = None,
             branch: str = "main") -> str:
    """Put `files` (name -> source file or content) in `cache` as `repo_id` at commit `sha`; returns the sha."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    sha = sha or hashlib.sha1(repo_id.encode() + branch.encode()).hexdigest()
    snapshot = repo / "snapshots" / sha
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, src in files.items():
        data = src if isinstance(src, bytes) else Path(src).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.exists() or link.is_symlink():
            link.unlink()
        os.symlink(os.path.relpath(blob, link.parent), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(sha)
    return sha


def add_folder(cache: Path, repo_id: str, folder: Path, **kwargs) -> str:
    """Every file of checkpoint `folder` as `repo_id`."""
    return add_repo(cache, repo_id, {p.name: p for p in sorted(folder.iterdir()) if p.is_file()}, **kwargs)
