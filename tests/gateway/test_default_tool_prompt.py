"""`tandem serve` with the embedded default pair, asked with real tool definitions (Berkeley Function Calling
Leaderboard entries, tests/data/bfcl_tools.json): a definition that fits the models' context is answered, with
the prompt counted exactly as transformers renders the models' chat template; one that does not fit is a 400
in OpenAI's error shape, never a 500. The entries that do not fit the default pair's context (none at 2,048
tokens) and one request carrying all the entries' functions at once are the refused group."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from live_server import start_serve, stop  # conftest puts tests/ on the path
from transformers import AutoTokenizer

from gateway.server import free_port

ROOT = Path(__file__).resolve().parents[2]
DATA = json.loads((ROOT / "tests" / "data" / "bfcl_tools.json").read_text())
CONTEXT = json.loads((ROOT / "models" / "tandem-tiny-l" / "config.json").read_text())["max_position_embeddings"]
MAX_TOKENS = 8

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def openai_tools(entry: dict) -> list[dict]:
    """BFCL's Python-style parameter types mapped to JSON Schema with BFCL's own table."""
    table = DATA["gorilla_to_openapi"]

    def conv(node):
        if isinstance(node, dict):
            return {k: (table.get(v, v) if k == "type" and isinstance(v, str) else conv(v)) for k, v in node.items()}
        return [conv(x) for x in node] if isinstance(node, list) else node

    return [{"type": "function", "function": conv(fn)} for fn in entry["function"]]


@pytest.fixture(scope="module")
def reference_tokens():
    tok = AutoTokenizer.from_pretrained(ROOT / "models" / "tandem-tiny-l")

    def count(entry: dict) -> int:
        text = tok.apply_chat_template(entry["question"], tools=openai_tools(entry), add_generation_prompt=True,
                                       tokenize=False)
        return len(tok.encode(text, add_special_tokens=False))

    return count


@pytest.fixture(scope="module")
def server():
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TANDEM_LOG_LEVEL": "warning"}
    env.pop("TANDEM_CONFIG", None)
    env.pop("TANDEM_API_KEYS", None)
    proc, url = start_serve(["--port", str(port)], env, port, timeout_s=180)
    try:
        yield url
    finally:
        stop(proc)


def ask(url: str, entry: dict, model: str) -> httpx.Response:
    body = {"model": model, "messages": entry["question"], "tools": openai_tools(entry), "max_tokens": MAX_TOKENS,
            "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def test_the_data_is_what_the_file_says(reference_tokens):
    assert len(DATA["entries"]) >= 6 and "ShishirPatil/gorilla" in DATA["source"]
    for entry in DATA["entries"]:
        assert reference_tokens(entry) == entry["rendered_tokens"], entry["id"]
    assert any(e["rendered_tokens"] + MAX_TOKENS <= CONTEXT for e in DATA["entries"])


@pytest.mark.parametrize("model", ["tandem-small", "tandem-large"])
def test_a_real_tool_definition_that_fits_is_answered(server, reference_tokens, model):
    fitting = [e for e in DATA["entries"] if e["rendered_tokens"] + MAX_TOKENS <= CONTEXT]
    for entry in fitting:
        r = ask(server, entry, model)
        assert r.status_code == 200, (entry["id"], r.text)
        out = r.json()
        assert out["usage"]["prompt_tokens"] == reference_tokens(entry), entry["id"]
        choice = out["choices"][0]
        assert choice["finish_reason"] in ("stop", "length", "tool_calls")
        assert 1 <= out["usage"]["completion_tokens"] <= MAX_TOKENS
        assert choice["message"]["role"] == "assistant"


def every_tool_at_once() -> dict:
    """One request carrying every entry's functions (an agent with all of them loaded) and the longest
    entry's question: past a 2,048-token context, where each entry alone fits."""
    longest = max(DATA["entries"], key=lambda e: e["rendered_tokens"])
    return {"id": "all-tools", "question": longest["question"],
            "function": [fn for e in DATA["entries"] for fn in e["function"]]}


def test_a_real_tool_definition_past_the_context_is_a_400(server, reference_tokens):
    too_long = [e for e in DATA["entries"] if e["rendered_tokens"] + MAX_TOKENS > CONTEXT]
    everything = every_tool_at_once()
    assert reference_tokens(everything) + MAX_TOKENS > CONTEXT
    too_long.append(everything)
    for entry in too_long:
        r = ask(server, entry, "tandem-large")
        assert r.status_code == 400, (entry["id"], r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"], err
