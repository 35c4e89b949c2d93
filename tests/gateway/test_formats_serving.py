"""What was loaded, said by the gateway: `/v1/models` cards carry per engine the source (Hub id with its
resolved revision, or the path), format, quantisation, weight bytes and context length, and the start-up log
says the same; engines come from a Hub id in an offline cache and from a GGUF file, through the config path
`tandem serve` uses (check_checkpoints, then the app)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import httpx
import pytest
from gguf_files import write_gguf  # conftest puts tests/ on the path
from hub_cache import add_folder
from tiny_checkpoints import CHATML

from gateway.config import config_from_dict
from gateway.engine_setup import check_checkpoints
from gateway.server import ServerThread

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_models_cards_and_log_say_what_was_loaded(tiny_checkpoint, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sha = add_folder(tmp_path / "hub", "tandem-org/tiny-s", ROOT / "models" / "tandem-tiny-s")
    src = tiny_checkpoint("llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    gguf_file = write_gguf(src, tmp_path / "tiny-q4_0.gguf", "Q4_0", chat_template=CHATML)
    cfg = config_from_dict({
        "engines": {"hub": {"checkpoint": "tandem-org/tiny-s", "max_model_len": 256},
                    "gguf": {"checkpoint": str(gguf_file), "max_model_len": 256, "quantization": "int8"}},
        "kv_pool": {"memory_bytes": 16 << 20},
        "routes": {"alias": {"engines": ["gguf"]}}})
    check_checkpoints(cfg)
    with caplog.at_level(logging.INFO, logger="tandem.load"), ServerThread(cfg) as srv:
        cards = {c["id"]: c for c in httpx.get(srv.url + "/v1/models").json()["data"]}
        one = httpx.get(srv.url + "/v1/models/gguf").json()
        chat = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "gguf", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0})
        tokens = httpx.post(srv.url + "/tokenize", json={"model": "gguf", "prompt": "hello world"}).json()
    hub = cards["hub"]["loaded"]
    assert hub == [{"engine": "hub", "source": f"tandem-org/tiny-s@{sha}", "format": "safetensors",
                    "quantization": "none", "weight_bytes": hub[0]["weight_bytes"],
                    "context_length": cards["hub"]["max_model_len"] and hub[0]["context_length"]}]
    from safetensors import safe_open

    with safe_open(str(ROOT / "models" / "tandem-tiny-s" / "model.safetensors"), "pt") as f:
        numel = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert hub[0]["weight_bytes"] == 4 * numel  # every stored tensor, float32 on the CPU (dtype auto)
    (gguf,) = cards["gguf"]["loaded"]
    assert gguf["source"] == str(gguf_file) and gguf["format"] == "gguf" and gguf["context_length"] == 512
    assert gguf["quantization"].startswith("gguf ") and "Q4_0->int4 x15" in gguf["quantization"]
    assert "floats quantised at load: int8" in gguf["quantization"]
    assert gguf["weight_bytes"] <= gguf_file.stat().st_size * 1.5  # int4 stays int4 (+ float embeddings)
    assert one["loaded"] == [gguf]
    assert cards["alias"]["kind"] == "route" and cards["alias"]["loaded"] == [gguf]
    # the GGUF's own tokenizer and chat template serve the chat request (ChatML prompt: 3 message tokens + ...)
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 3
    assert chat.json()["usage"]["prompt_tokens"] > 4 and tokens["count"] == len(tokens["tokens"]) > 1
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.load"]
    assert any(f"engine hub: loaded tandem-org/tiny-s@{sha} (safetensors, quantization none)" in m for m in lines)
    assert any(m.startswith(f"engine gguf: loaded {gguf_file} (gguf, quantization gguf ") for m in lines)
