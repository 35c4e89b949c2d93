"""Hugging Face Hub ids (ORG/NAME): `snapshot_download` of the config, tokenizer and safetensors files only
(never pickled .bin weights), honouring HF_TOKEN, HF_HOME / HF_HUB_CACHE and HF_HUB_OFFLINE as they are when
called; one resolution per (id, revision) per process.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from engines.model_config import CheckpointError

log = logging.getLogger("tandem.hub")

# What tandem reads from a repository; everything else (pickles, ONNX, GGUF copies...) stays on the Hub.
ALLOW_PATTERNS = [
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "*.safetensors",
    "model.safetensors.index.json", "quantize_config.json", "quant_config.json",
]
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")
_resolved: dict[tuple, tuple[Path, str]] = {}


def is_hub_id(value: str) -> bool:
    """ORG/NAME, as the Hub spells repository ids (one slash, no '..', no leading './' or '/')."""
    return bool(_HUB_ID.match(value)) and ".." not in value and not value.endswith(".gguf")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", os.environ.get("TRANSFORMERS_OFFLINE", "")).strip().upper() in (
        "1", "ON", "YES", "TRUE")


def cache_dir() -> Path:
    """The Hub cache the library itself would use, read from the environment now (not at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def download(repo_id: str, revision: str | None = None) -> tuple[Path, str]:
    """(snapshot folder, commit sha) of `repo_id` at `revision` (default main); CheckpointError naming the
    repository otherwise: not cached while offline, not found, gated, or pickle weights only."""
    key = (repo_id, revision, str(cache_dir()), _offline())
    if key in _resolved:
        return _resolved[key]
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = _offline()
    where = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                        cache_dir=str(cache_dir()), local_files_only=offline,
                                        token=os.environ.get("HF_TOKEN") or None))
    except RevisionNotFoundError:
        raise CheckpointError(f"{where}: no such revision on the Hugging Face Hub") from None
    except GatedRepoError:
        raise CheckpointError(f"{where}: the repository is gated: accept its terms on huggingface.co and set "
                              "HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{where}: neither a local path nor a repository on the Hugging Face Hub (if it "
                              "is private, set HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        if offline:
            raise CheckpointError(f"{where}: neither a local path nor in the Hub cache {cache_dir()}, and "
                                  "HF_HUB_OFFLINE is set: download it once online, or unset HF_HUB_OFFLINE") from None
        raise CheckpointError(f"{where}: cannot reach the Hugging Face Hub and it is not in the cache "
                              f"{cache_dir()}") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise CheckpointError(f"{where}: download failed ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    sha = folder.name
    _check_weights(repo_id, folder, revision, offline)
    log.info("hub: %s resolved to revision %s (%s)", repo_id, sha, folder)
    _resolved[key] = (folder, sha)
    return folder, sha


def _check_weights(repo_id: str, folder: Path, revision: str | None, offline: bool) -> None:
    if any(folder.glob("*.safetensors")):
        return
    names = [p.name for p in folder.iterdir()]
    if not offline:
        try:
            from huggingface_hub import HfApi

            names += HfApi(token=os.environ.get("HF_TOKEN") or None).list_repo_files(repo_id, revision=revision)
        except Exception:  # the listing only improves the message
            pass
    pickles = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt")))
    ggufs = sorted(n for n in names if n.endswith(".gguf"))
    if pickles:
        raise CheckpointError(f"{repo_id}: the repository has only pickle weights ({', '.join(pickles[:3])}); "
                              "tandem loads safetensors only (convert them, or pick a safetensors repository)")
    if ggufs:
        raise CheckpointError(f"{repo_id}: the repository has GGUF files only ({', '.join(ggufs[:3])}); download "
                              "one (huggingface-cli download REPO FILE) and serve the .gguf path")
    raise CheckpointError(f"{repo_id}: the repository has no safetensors weights")
