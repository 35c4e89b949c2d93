"""Hub ids (engines/formats/hub.py) through the real huggingface_hub with HF_HUB_OFFLINE=1 and a cache laid out
in a temporary folder: `LLM("ORG/NAME")` and `tandem serve ORG/NAME` load the cached snapshot (the same tokens
as the folder itself), `revision` picks a commit or branch, and a repository with pickle weights only, a Hub
id not in the cache, or an unknown revision stop with one line naming the repository."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hub_cache import add_folder, add_repo  # conftest puts tests/ on the path

from engines import LLM, SamplingParams
from engines.model_config import CheckpointError

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tandem-tiny-s"
PROMPTS = ["The quick brown fox", "def read_config(path):"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture()
def hub(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_hub_id_loads_the_cached_snapshot_like_the_folder(hub):
    sha = add_folder(hub, "tandem-org/tiny-s", TINY)
    llm = LLM("tandem-org/tiny-s", max_model_len=256)
    info = llm.engine.model.load_info
    assert info["source"] == f"tandem-org/tiny-s@{sha}" and info["format"] == "safetensors"
    assert info["quantization"] == "none" and info["weight_bytes"] > 0
    assert Path(info["path"]) == hub / "models--tandem-org--tiny-s" / "snapshots" / sha
    assert _tokens(llm) == _tokens(LLM(TINY, max_model_len=256))


def test_revision_picks_a_commit_or_branch(hub):
    main = add_folder(hub, "tandem-org/tiny-s", TINY)
    other = add_folder(hub, "tandem-org/tiny-s", TINY, sha="b" * 40, branch="dev")
    assert LLM("tandem-org/tiny-s", revision="dev").engine.model.load_info["source"].endswith("@" + other)
    assert LLM("tandem-org/tiny-s", revision=main).engine.model.load_info["source"].endswith("@" + main)
    with pytest.raises(CheckpointError, match=r"tandem-org/tiny-s \(revision nope\): neither a local path nor "
                                              r"in the Hub cache .*HF_HUB_OFFLINE"):
        LLM("tandem-org/tiny-s", revision="nope")


def test_revision_of_a_local_folder_is_refused():
    with pytest.raises(CheckpointError, match="applies to Hub ids only"):
        LLM(TINY, revision="main")


def test_pickle_only_repository_is_refused(hub):
    add_repo(hub, "tandem-org/pickles", {"config.json": TINY / "config.json",
                                         "pytorch_model.bin": b"\x80\x04not loaded"})
    with pytest.raises(CheckpointError) as err:
        LLM("tandem-org/pickles")
    assert str(err.value) == ("tandem-org/pickles: the repository has only pickle weights (pytorch_model.bin); "
                              "tandem loads safetensors only (convert them, or pick a safetensors repository)")


def test_serve_config_path_resolves_hub_ids_for_model_and_draft(hub):
    from gateway.config import ConfigError
    from gateway.engine_setup import check_checkpoints, engine_core_args
    from gateway.server import build_parser, config_from_args

    add_folder(hub, "tandem-org/tiny-s", TINY)
    add_folder(hub, "tandem-org/tiny-l", ROOT / "models" / "tandem-tiny-l")
    args = build_parser().parse_args(["tandem-org/tiny-l", "--draft", "tandem-org/tiny-s", "--revision", "main"])
    cfg = config_from_args(args, env={})
    assert cfg.engines["tandem-org/tiny-l"].checkpoint == "tandem-org/tiny-l"
    assert cfg.engines["tandem-org/tiny-l"].revision == "main"
    assert cfg.engines["tandem-org/tiny-l-draft"].checkpoint == "tandem-org/tiny-s"
    check_checkpoints(cfg)
    specs, _, _ = engine_core_args(cfg)
    assert {s.model for s in specs} == {"tandem-org/tiny-l", "tandem-org/tiny-s"}

    missing = config_from_args(build_parser().parse_args(["tandem-org/absent"]), env={})
    with pytest.raises(ConfigError, match="tandem-org/absent: neither a local path nor in the Hub cache"):
        check_checkpoints(missing)


def test_serve_hub_id_not_cached_is_one_line_without_traceback(tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    env.pop("TANDEM_CONFIG", None)
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "tandem-org/absent", "--port", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith("tandem serve: configuration error: tandem serve tandem-org/absent: "
                               "engines.tandem-org/absent.checkpoint: tandem-org/absent: neither a local path")


def test_gguf_only_repository_says_to_serve_the_file(hub):
    add_repo(hub, "tandem-org/tiny-gguf", {"README.md": b"gguf files", "tiny-q8_0.gguf": b"GGUF"})
    with pytest.raises(CheckpointError, match=r"^tandem-org/tiny-gguf: the repository has GGUF files only "
                                              r"\(tiny-q8_0.gguf\); download one .* and serve the .gguf path$"):
        LLM("tandem-org/tiny-gguf")
