"""Where a model comes from and in which format: `resolve` turns what the user wrote (a folder, a .gguf file,
a Hugging Face Hub id) into a local `ModelSource`; hub.py downloads, gguf.py reads GGUF files, prequant.py
loads checkpoints another tool quantised.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engines.model_config import CheckpointError


@dataclass(frozen=True)
class ModelSource:
    given: str  # what the user wrote
    path: Path  # the local folder, or the .gguf file
    kind: str  # "folder" | "hub" | "gguf"
    repo_id: str | None = None
    revision: str | None = None  # the resolved commit for a Hub id

    @property
    def format(self) -> str:
        return "gguf" if self.path.suffix.lower() == ".gguf" else "safetensors"

    def describe(self) -> str:
        if self.repo_id is not None:
            return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id
        return str(self.path)


def resolve(model: str | Path, revision: str | None = None) -> ModelSource:
    """A local folder or .gguf file as it is; else a Hub id (ORG/NAME) resolved through the Hub cache."""
    from engines.formats import hub

    given = str(model)
    path = Path(given).expanduser()
    if path.exists():
        if revision is not None:
            raise CheckpointError(f"{path}: revision={revision!r} applies to Hub ids only, not to a local path")
        kind = "gguf" if path.is_file() and path.suffix.lower() == ".gguf" else "folder"
        return ModelSource(given=given, path=path, kind=kind)
    if hub.is_hub_id(given):
        folder, sha = hub.download(given, revision)
        return ModelSource(given=given, path=folder, kind="hub", repo_id=given, revision=sha)
    if path.suffix.lower() == ".gguf":
        raise CheckpointError(f"{path}: GGUF file does not exist")
    raise CheckpointError(f"{path}: checkpoint folder does not exist (nor is it a Hub id ORG/NAME)")
