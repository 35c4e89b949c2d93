"""The HTTP edge against inputs that used to cost a 500 or hold a connection forever (issue 20, items 3, 6, 9):
content parts a text model cannot take, nesting a decoder recurses on, seeds the generator cannot hold,
lenient types, non-JSON bodies, oversized heads, and heads or bodies that never finish arriving. A real
server on 127.0.0.1 over a tiny checkpoint; the HTTP limits are shortened so every wait is about a second.
"""

from __future__ import annotations

import json
import re
import select
import shutil
import socket
import time

import httpx
import pytest

from gateway.config import config_from_dict
from gateway.protocol import (
    MAX_JSON_DEPTH,
    ChatCompletionRequest,
    InvalidParameter,
    decode_request,
    nests_deeper_than,
)
from gateway.server import HTTPLimits, ServerThread
from gateway.strict_request import StrictJSONRequest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "user", "content": "Say hello"}]
LIMITS = HTTPLimits(max_header_bytes=64 << 10, header_timeout_s=1.0, body_timeout_s=1.0)


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("hardening") / "tiny"
    shutil.copytree(tiny_checkpoint("llama"), ckpt)
    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "chat_template": CHATML}))
    cfg = config_from_dict({"engines": {"tiny": {"checkpoint": str(ckpt)}}, "kv_pool": {"memory_bytes": 32 << 20}})
    with ServerThread(cfg, http_limits=LIMITS) as srv:
        yield srv


def _post(server, path: str, body: object, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30, **kwargs)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def _chat(**fields) -> dict:
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **fields}


# ------------------------------------------------------------------ item 3: client errors are 400s, not 500s


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}])
def test_a_non_text_content_part_is_a_400_naming_its_type(server, part):
    messages = [{"role": "system", "content": "terse"},
                {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    err = _error(_post(server, "/v1/chat/completions", _chat(messages=messages)), 400)
    assert err["param"] == "messages[1].content[1].type"
    assert part["type"] in err["message"] and err["type"] == "invalid_request_error"


def test_text_content_parts_are_joined_and_served(server):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]}]
    r = _post(server, "/v1/chat/completions", _chat(messages=messages))
    assert r.status_code == 200, r.text


def test_a_body_nested_100000_deep_is_a_400(server):
    depth = 100_000
    r = httpx.post(server.url + "/v1/chat/completions", content=b"[" * depth + b"]" * depth,
                   headers={"content-type": "application/json"}, timeout=30)
    err = _error(r, 400)
    assert err["code"] == "invalid_json" and str(MAX_JSON_DEPTH) in err["message"]


def test_chat_template_kwargs_nested_5000_deep_is_a_400(server):
    deep = b'{"a": ' * 5000 + b"1" + b"}" * 5000  # json.dumps itself cannot nest this deep
    body = json.dumps(_chat()).encode()[:-1] + b', "chat_template_kwargs": {"deep": ' + deep + b"}}"
    r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    assert _error(r, 400)["code"] == "invalid_json"


def test_nesting_inside_strings_is_not_nesting():
    text = "[{" * 10_000 + '\\"' + "]}" * 10
    body = json.dumps(_chat(messages=[{"role": "user", "content": text}])).encode()
    assert not nests_deeper_than(body, MAX_JSON_DEPTH)
    assert decode_request(body, ChatCompletionRequest).messages[0].content == text
    nested = b'{"a": ' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1)
    assert nests_deeper_than(nested, MAX_JSON_DEPTH) and not nests_deeper_than(nested, MAX_JSON_DEPTH + 1)


@pytest.mark.parametrize("seed,n", [(2**70, 1), (2**64 - 1, 2), (-(2**63) - 1, 1)])
def test_a_seed_the_generator_cannot_take_is_a_400_naming_seed(server, seed, n):
    err = _error(_post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                    "temperature": 1.0, "seed": seed, "n": n}), 400)
    assert err["param"] == "seed" and str(seed) in err["message"]


@pytest.mark.parametrize("seed,n", [(2**64 - 1, 1), (2**64 - 2, 2), (-(2**63), 2)])
def test_seeds_at_the_edge_of_the_generator_range_sample(server, seed, n):
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 1.0,
                                          "seed": seed, "n": n})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == n


# ------------------------------------------------------------------------------- item 9: strict types


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p", "presence_penalty"])
def test_nan_as_a_string_is_refused_naming_the_field(server, field):
    assert _error(_post(server, "/v1/chat/completions", _chat(**{field: "NaN"})), 400)["param"] == field


@pytest.mark.parametrize("fields,param", [({"max_tokens": "2"}, "max_tokens"), ({"temperature": "0.5"}, "temperature"),
                                          ({"stream": "false"}, "stream"), ({"logprobs": "true"}, "logprobs"),
                                          ({"n": 1.5}, "n"), ({"ignore_eos": 1}, "ignore_eos")])
def test_strings_and_numbers_are_not_coerced(server, fields, param):
    err = _error(_post(server, "/v1/chat/completions", _chat(**fields)), 400)
    assert err["param"] == param and err["code"] == "invalid_value"


def test_numbers_out_of_float_range_are_refused(server):
    body = json.dumps(_chat()).encode()[:-1] + b', "temperature": 1e400}'
    r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert _error(r, 400)["param"] == "temperature"


@pytest.mark.parametrize("role", ["wizard", "System", ""])
def test_an_unknown_role_is_a_400_naming_it(server, role):
    err = _error(_post(server, "/v1/chat/completions", _chat(messages=[{"role": role, "content": "hi"}])), 400)
    assert err["param"] == "messages[0].role"


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool"])
def test_every_openai_role_is_accepted(server, role):
    messages = [{"role": role, "content": "context"}, {"role": "user", "content": "hi"}]
    assert _post(server, "/v1/chat/completions", _chat(messages=messages)).status_code == 200


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_non_json_body_is_a_415(server, ctype):
    r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps(_chat()).encode(),
                   headers={"content-type": ctype})
    err = _error(r, 415)
    assert err["code"] == "unsupported_media_type" and ctype in err["message"]


@pytest.mark.parametrize("ctype", ["application/json; charset=utf-8", "application/vnd.api+json", None])
def test_json_bodies_with_parameters_suffixes_or_no_content_type_are_served(server, ctype):
    headers = {"content-type": ctype} if ctype else {}
    r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps(_chat()).encode(), headers=headers)
    assert r.status_code == 200, r.text


def test_decoding_errors_name_nested_fields():
    with pytest.raises(InvalidParameter) as missing:
        decode_request(b'{"model": "m", "messages": [{"content": "x"}]}', ChatCompletionRequest)
    assert missing.value.param == "messages[0].role" and missing.value.code == "missing_required_parameter"
    with pytest.raises(InvalidParameter) as typed:
        decode_request(b'{"model": "m", "messages": [{"role": "user"}], "stop": [1]}', ChatCompletionRequest)
    assert typed.value.param == "stop" or typed.value.param == "stop[0]"
    with pytest.raises(InvalidParameter) as array:
        decode_request(b"[]", ChatCompletionRequest)
    assert array.value.param is None and "Expected `object`" in str(array.value)


# --------------------------------------------------------------------- item 6: header size and read deadlines


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.settimeout(5)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (or 5 s pass)."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def _body(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


def _request_head(path: str, body_len: int, extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            % (path.encode(), body_len)) + extra + b"\r\n"


@pytest.mark.parametrize("headers", [b"x-big: " + b"a" * (65 << 10) + b"\r\n",
                                     b"".join(b"x-h%d: %s\r\n" % (i, b"b" * 1000) for i in range(80))])
def test_a_head_over_64_kib_is_a_431(server, headers):
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n" + headers + b"\r\n")
        response = _read_all(sock)
    assert _status(response) == 431
    assert _body(response)["error"]["code"] == "request_header_fields_too_large"


def test_a_64_mb_header_is_cut_off_early(server):
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nx-huge: ")
        sent = 0
        try:
            while sent < 64 << 20:
                sock.sendall(b"a" * (1 << 20))
                sent += 1 << 20
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert sent < 32 << 20  # refused after a read buffer and the linger allowance, not the whole header
        response = _read_all(sock)
    assert not response or _status(response) == 431


def test_headers_just_under_the_limit_are_served(server):
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\nx-big: "
                     + b"a" * (60 << 10) + b"\r\n\r\n")
        assert _status(_read_all(sock)) == 200


def test_a_slow_head_is_a_408_after_the_header_deadline(server):
    with _connect(server) as sock:
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n")
        for _ in range(3):  # trickling keeps the socket alive but never finishes the head
            time.sleep(0.25)
            sock.sendall(b"x-slow: 1\r\n")
        response = _read_all(sock)
        elapsed = time.monotonic() - start
    assert _status(response) == 408 and _body(response)["error"]["code"] == "request_timeout"
    assert LIMITS.header_timeout_s - 0.1 <= elapsed < LIMITS.header_timeout_s + 2


def test_a_connection_that_sends_nothing_is_closed(server):
    with _connect(server) as sock:
        start = time.monotonic()
        assert _read_all(sock) == b""
        assert time.monotonic() - start < LIMITS.header_timeout_s + 2


def test_a_body_shorter_than_its_content_length_is_a_408(server):
    body = json.dumps(_chat()).encode()
    with _connect(server) as sock:
        start = time.monotonic()
        sock.sendall(_request_head("/v1/chat/completions", len(body) + 100) + body)
        response = _read_all(sock)
        elapsed = time.monotonic() - start
    assert _status(response) == 408 and _body(response)["error"]["code"] == "request_timeout"
    assert elapsed < LIMITS.body_timeout_s + 2


def _errors_counted(server, status: int) -> float:
    lines = httpx.get(server.url + "/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("tandem:request_errors_total{") and f'status="{status}"' in line)


def test_a_body_cut_off_by_its_deadline_is_not_counted_as_a_server_error(server):
    before_500, before_499 = _errors_counted(server, 500), _errors_counted(server, 499)
    with _connect(server) as sock:
        sock.sendall(_request_head("/v1/completions", 100) + b'{"model": ')
        assert _status(_read_all(sock)) == 408
    deadline = time.monotonic() + 5
    while _errors_counted(server, 499) == before_499 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _errors_counted(server, 499) == before_499 + 1 and _errors_counted(server, 500) == before_500


def test_a_trickled_body_is_a_408_at_the_body_deadline(server):
    body = json.dumps(_chat()).encode()
    with _connect(server) as sock:
        sock.sendall(_request_head("/v1/chat/completions", len(body)))
        start = time.monotonic()
        for byte in body:  # one byte every 0.1 s would take far longer than the deadline
            sock.sendall(bytes([byte]))
            answered, _, _ = select.select([sock], [], [], 0.1)
            if answered or time.monotonic() - start > LIMITS.body_timeout_s + 2:
                break
        response = _read_all(sock)
        elapsed = time.monotonic() - start
    assert _status(response) == 408
    assert LIMITS.body_timeout_s - 0.1 <= elapsed < LIMITS.body_timeout_s + 2


def test_an_early_answer_is_not_followed_by_a_408(server):
    with _connect(server) as sock:  # a body over max_body_bytes is answered 413 before it arrives
        sock.sendall(_request_head("/v1/chat/completions", 50 << 20))
        response = _read_all(sock)
    assert response.count(b"HTTP/1.1 ") == 1 and _status(response) == 413


def test_keep_alive_requests_and_a_body_sent_after_a_pause_are_served(server):
    body = json.dumps(_chat()).encode()
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        first = sock.recv(65536)
        assert _status(first) == 200
        sock.sendall(_request_head("/v1/chat/completions", len(body), b"connection: close\r\n"))
        time.sleep(0.4)  # within the body deadline
        sock.sendall(body)
        response = _read_all(sock)
    assert _status(response) == 200 and _body(response)["object"] == "chat.completion"


def test_the_app_decodes_bodies_with_the_strict_request(server):
    assert server.app.request_class is StrictJSONRequest


def test_the_server_still_serves_after_every_refusal(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert _post(server, "/v1/chat/completions", _chat()).status_code == 200


def test_an_empty_body_is_a_400(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"", headers={"content-type": "application/json"})
    assert _error(r, 400)["type"] == "invalid_request_error"


def test_pipelined_requests_are_answered_in_order_and_a_stalled_third_head_is_a_408(server):
    body = json.dumps(_chat()).encode()
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n" + _request_head("/v1/chat/completions", len(body))
                     + body + b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n")
        response = _read_all(sock)
    assert re.findall(rb"HTTP/1.1 (\d{3}) ", response) == [b"200", b"200", b"408"]
