"""The loose edges a hostile-input campaign found (issue 33, items 4 and 5), each now a 4xx in OpenAI's shape that
names the field: stop token ids out of range, NaN / Infinity literals, malformed HTTP, /tokenize past the
context; integers written as 2.0 (JSON Schema's integers) served; OPTIONS listing every method of a path; the
published bound of /v1/autoscale's `replicas`. A real server on 127.0.0.1 over two engines on one tiny
checkpoint (so several routes share one tokenizer).
"""

from __future__ import annotations

import json
import shutil
import socket

import httpx
import pytest

from gateway.config import config_from_dict
from gateway.server import ServerThread

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("edges") / "tiny"
    shutil.copytree(tiny_checkpoint("llama"), ckpt)
    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "chat_template": CHATML}))
    cfg = config_from_dict({"engines": {"one": {"checkpoint": str(ckpt)}, "two": {"checkpoint": str(ckpt)}},
                            "kv_pool": {"memory_bytes": 32 << 20}, "autoscale": {"max_replicas": 6}})
    with ServerThread(cfg) as srv:
        yield srv


def _post(server, path: str, body: object) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def _completion(**fields) -> dict:
    return {"model": "one", "prompt": "def main():", "max_tokens": 2, **fields}


@pytest.mark.parametrize("ids, param", [([-1], "stop_token_ids[0]"), ([2**70], "stop_token_ids[0]"),
                                        ([3, 2**31], "stop_token_ids[1]"), ([5000], "stop_token_ids"),
                                        (list(range(65)), "stop_token_ids")])
def test_stop_token_ids_outside_the_vocabulary_are_a_400_naming_the_field(server, ids, param):
    err = _error(_post(server, "/v1/completions", _completion(stop_token_ids=ids)), 400)
    assert err["param"] == param, err


def test_stop_token_ids_inside_the_vocabulary_are_served(server):
    r = _post(server, "/v1/completions", _completion(stop_token_ids=[0, 383]))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("raw, param", [('"temperature": NaN', "temperature"), ('"top_p": Infinity', "top_p"),
                                        ('"logit_bias": {"7": -Infinity}', "logit_bias.7")])
def test_nan_and_infinity_literals_are_a_400_naming_the_field(server, raw, param):
    body = '{"model": "one", "prompt": "x", "max_tokens": 1, ' + raw + "}"
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    err = _error(r, 400)
    assert err["param"] == param and "NaN and Infinity" in err["message"], err


def test_integers_written_as_whole_floats_are_integers(server):
    """JSON Schema (so the published document) counts 2.0 as an integer; 2.5 stays a 400."""
    r = _post(server, "/v1/completions", _completion(max_tokens=2.0, n=1.0, seed=7.0))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    assert _error(_post(server, "/v1/completions", _completion(max_tokens=2.5)), 400)["param"] == "max_tokens"


@pytest.mark.parametrize("raw", [b"GARBAGE / HTTP/1.1\r\n\r\n",
                                 b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
                                 b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"])  # a TLS hello on plain HTTP
def test_malformed_http_gets_an_openai_json_400(server, raw):
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), data
    assert b"content-type: application/json" in head.lower()
    err = json.loads(body)["error"]
    assert err["code"] == "invalid_http_request" and err["type"] == "invalid_request_error", err


def test_options_lists_every_method_a_path_serves(server):
    assert httpx.options(server.url + "/v1/autoscale").headers["allow"] == "GET, OPTIONS, POST"
    assert httpx.options(server.url + "/v1/chat/completions").headers["allow"] == "OPTIONS, POST"


def test_the_published_replicas_bound_is_the_one_enforced(server):
    doc = httpx.get(server.url + "/schema/openapi.json").json()
    for method in ("get", "post"):
        (param,) = [p for p in doc["paths"]["/v1/autoscale"][method]["parameters"] if p["name"] == "replicas"]
        schemas = param["schema"].get("oneOf", [param["schema"]])
        assert [s.get("maximum") for s in schemas if s.get("type") == "integer"] == [6], param
    assert httpx.get(server.url + "/v1/autoscale", params={"replicas": 6}).status_code == 200
    assert _error(httpx.get(server.url + "/v1/autoscale", params={"replicas": 7}), 400)["param"] == "replicas"


def test_tokenize_without_model_uses_the_shared_tokenizer(server):
    """Published optional: with several routes whose engines share one tokenizer, the answer is the same."""
    plain = _post(server, "/tokenize", {"prompt": "def main():"})
    named = _post(server, "/tokenize", {"prompt": "def main():", "model": "two"})
    assert plain.status_code == 200, plain.text
    assert plain.json()["tokens"] == named.json()["tokens"] and plain.json()["count"] > 0


def test_tokenize_past_the_context_is_a_400_before_and_after_tokenising(server):
    max_len = _post(server, "/tokenize", {"prompt": "x"}).json()["max_model_len"]
    huge = "x" * (max_len * 16 + 1)  # more characters than the context can hold: refused before any work
    err = _error(_post(server, "/tokenize", {"prompt": huge}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    words = " ".join(["def"] * (max_len + 10))  # few characters a token: refused by its count
    err = _error(_post(server, "/tokenize", {"prompt": words}), 400)
    assert err["code"] == "context_length_exceeded" and str(max_len) in err["message"]


def test_token_id_prompts_written_as_whole_floats_are_token_ids(server):
    ids = _post(server, "/tokenize", {"prompt": "def main():"}).json()["tokens"]
    as_ints = _post(server, "/v1/completions", _completion(prompt=ids, temperature=0))
    as_floats = _post(server, "/v1/completions", _completion(prompt=[float(t) for t in ids], temperature=0))
    assert as_floats.status_code == 200, as_floats.text
    assert as_floats.json()["choices"][0]["text"] == as_ints.json()["choices"][0]["text"]
    err = _error(_post(server, "/v1/completions", _completion(prompt=[ids[0] + 0.5])), 400)
    assert err["param"] == "prompt"


# ------------------------------------------- the prompt's checks: engines/input_processor.py, for both paths

def _vocab(tiny_checkpoint) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_checkpoint("llama") / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


def _scored(prompt) -> dict:
    return {"model": "one", "prompt": prompt, "max_tokens": 0, "echo": True}


def test_prompt_only_refusals_name_the_prompt_and_say_why(server, tiny_checkpoint):
    """max_tokens 0 with echo scores the prompt and generates nothing: it may fill the whole context, and its
    ids must be the tokenizer's (they are echoed as text)."""
    ctx, vocab = 512, _vocab(tiny_checkpoint)
    assert _post(server, "/tokenize", {"prompt": "x"}).json()["max_model_len"] == ctx
    err = _error(_post(server, "/v1/completions", _scored([5] * (ctx + 1))), 400)
    assert (err["message"], err["param"], err["code"]) == (
        f"The prompt has {ctx + 1} tokens but 'one' has a context of {ctx}", "prompt", "context_length_exceeded")
    full = _post(server, "/v1/completions", _scored([5] * ctx))
    assert full.status_code == 200 and full.json()["usage"]["prompt_tokens"] == ctx, full.text
    err = _error(_post(server, "/v1/completions", _scored([3, vocab])), 400)
    assert (err["message"], err["param"], err["code"]) == (
        f"prompt token ids must be below {vocab} for model 'one'", "prompt", "invalid_value")
    err = _error(_post(server, "/v1/completions", _scored([[3, 4], [3, vocab]])), 400)
    assert err["param"] == "prompt[1]" and err["code"] == "invalid_value", err


def test_generation_refusals_say_which_field_to_change(server, tiny_checkpoint):
    """The same checks where a token is to be generated: the prompt needs room for one, max_tokens on top of
    it must fit, ids must be the model's."""
    ctx, vocab = 512, 384
    err = _error(_post(server, "/v1/completions", _completion(prompt=[5] * ctx)), 400)
    assert (err["message"], err["param"], err["code"]) == (
        f"the prompt has {ctx} tokens but 'one' has a context of {ctx}: shorten the prompt to at most {ctx - 1}",
        None, "context_length_exceeded")
    err = _error(_post(server, "/v1/completions", _completion(prompt=[5] * 10, max_tokens=ctx)), 400)
    assert (err["message"], err["param"], err["code"]) == (
        f"max_tokens={ctx} plus the prompt's 10 tokens exceeds the context of {ctx} tokens: lower max_tokens to "
        f"at most {ctx - 10}", "max_tokens", "context_length_exceeded")
    err = _error(_post(server, "/v1/completions", _completion(prompt=[3, vocab])), 400)
    assert (err["message"], err["param"], err["code"]) == (
        f"prompt token ids must be in [0, {vocab}) for model 'one'", None, "invalid_request")
    err = _error(_post(server, "/v1/completions", _completion(logit_bias={str(vocab): 1})), 400)
    assert (err["message"], err["param"], err["code"]) == (
        f"logit_bias token ids must be in [0, {vocab}) for model 'one'", "logit_bias", "invalid_request")
