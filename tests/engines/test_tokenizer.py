"""Tokenizer: chat templates render exactly as transformers' apply_chat_template, streaming detokenisation
equals the full decode without ever emitting a broken character, and the EOS set gathers every source."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tokenizers
from tiny_checkpoints import build_tokenizer

import engines.tokenizer as tokenizer_module
from engines.model_config import CheckpointError
from engines.tokenizer import ChatTemplateError, Tokenizer

HEADER_TOKENS = ["<|start_header_id|>", "<|end_header_id|>"]

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have these functions:\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CHATML_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama-2 / Mistral shape: a system prompt folded into the first user turn, strict role alternation.
SYSTEM_STRICT_TEMPLATE = """{% if messages[0]['role'] == 'system' %}
{% set loop_messages = messages[1:] %}
{% set system_message = messages[0]['content'] %}
{% else %}
{% set loop_messages = messages %}
{% set system_message = false %}
{% endif %}
{% for message in loop_messages %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{% endif %}
{% if loop.index0 == 0 and system_message != false %}
{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}
{% else %}
{% set content = message['content'] %}
{% endif %}
{% if message['role'] == 'user' %}
{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}
{% elif message['role'] == 'assistant' %}
{{ ' '  + content.strip() + ' ' + eos_token }}
{% endif %}
{% endfor %}
"""

CONVERSATION = [
    {"role": "system", "content": "Réponds brièvement. 简短回答。"},
    {"role": "user", "content": "  What is 2 + 2? 🙂 "},
    {"role": "assistant", "content": "4, naturally."},
    {"role": "user", "content": "And ünïcödé?"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter in °C",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def make_tokenizer_folder(root: Path, name: str, chat_template=None, jinja_file: str | None = None,
                          **config_overrides) -> Path:
    """A tokenizer-only folder (tiny BPE + header special tokens), as a checkpoint would ship it."""
    folder = root / name
    build_tokenizer(folder)
    backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    backend.add_special_tokens(HEADER_TOKENS)
    backend.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if chat_template is not None:
        config["chat_template"] = chat_template
    config.update(config_overrides)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "eos_token_id": 1}))
    if jinja_file is not None:
        (folder / "chat_template.jinja").write_text(jinja_file)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "llama3": make_tokenizer_folder(root, "llama3", LLAMA3_TEMPLATE, eos_token="<|eot_id|>"),
        "chatml": make_tokenizer_folder(root, "chatml", CHATML_TEMPLATE, eos_token="<|im_end|>"),
        "system_strict": make_tokenizer_folder(root, "system_strict", SYSTEM_STRICT_TEMPLATE),
        "named_list": make_tokenizer_folder(root, "named_list", [
            {"name": "default", "template": CHATML_TEMPLATE}, {"name": "tool_use", "template": LLAMA3_TEMPLATE}]),
        "jinja_file": make_tokenizer_folder(root, "jinja_file", "{{ 'from tokenizer_config' }}",
                                            jinja_file=CHATML_TEMPLATE),
        "plain": make_tokenizer_folder(root, "plain"),
    }


def transformers_render(folder: Path, messages, **kwargs) -> str:
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(folder)
    return hf.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("shape", ["llama3", "chatml", "system_strict", "named_list", "jinja_file"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(folders, shape, add_generation_prompt):
    messages = CONVERSATION
    if shape == "system_strict":
        messages = CONVERSATION[:3]  # ends on an assistant turn; this template has no generation prompt
    ours = Tokenizer.from_pretrained(folders[shape]).apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt)
    theirs = transformers_render(folders[shape], messages, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert "Réponds brièvement" in ours


@pytest.mark.parametrize("shape", ["llama3", "chatml", "named_list"])
def test_chat_template_with_tools_renders_like_transformers(folders, shape):
    ours = Tokenizer.from_pretrained(folders[shape]).apply_chat_template(CONVERSATION[1:], tools=TOOLS)
    theirs = transformers_render(folders[shape], CONVERSATION[1:], tools=TOOLS, add_generation_prompt=True)
    assert ours == theirs
    assert "Wetter in °C" in ours  # tojson keeps non-ASCII, as transformers' filter does


def test_llama3_header_tokens_encode_as_single_special_ids(folders):
    tok = Tokenizer.from_pretrained(folders["llama3"])
    text = tok.apply_chat_template(CONVERSATION[1:2])
    ids = tok.encode(text)
    header_ids = [tok.backend.token_to_id(t) for t in HEADER_TOKENS]
    assert ids[0] == tok.bos_token_id
    assert ids.count(header_ids[0]) == 3 and ids.count(header_ids[1]) == 3  # system, user, assistant
    assert set(header_ids) <= set(tok.all_special_ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_raise_exception_gives_chat_template_error_with_template_message(folders):
    tok = Tokenizer.from_pretrained(folders["system_strict"])
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match=r"^Conversation roles must alternate user/assistant/user/assistant/\.\.\.$"):
        tok.apply_chat_template(bad)
    import jinja2
    with pytest.raises(jinja2.TemplateError, match="Conversation roles must alternate"):
        transformers_render(folders["system_strict"], bad)


def test_template_without_chat_template_and_syntax_errors_are_chat_template_errors(folders):
    tok = Tokenizer.from_pretrained(folders["plain"])
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(CONVERSATION)
    with pytest.raises(ChatTemplateError, match="chat template syntax error at line 1"):
        tok.apply_chat_template(CONVERSATION, chat_template="{% for m in messages %}{{ m }")


def test_generation_tag_and_none_content_render_like_transformers(folders):
    template = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                "{% endgeneration %}{% else %}{{ m.role }}: {{ m.content | default('-') }}\n{% endif %}{% endfor %}")
    messages = [{"role": "user", "content": None}, {"role": "assistant", "content": "ok"}]
    ours = Tokenizer.from_pretrained(folders["plain"]).apply_chat_template(messages, chat_template=template)
    assert ours == transformers_render(folders["plain"], messages, chat_template=template) == "user: -\nok"


def test_template_sandbox_blocks_interpreter_internals(folders):
    tok = Tokenizer.from_pretrained(folders["plain"])
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(CONVERSATION, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")


# ---- detokenisation

STREAM_TEXTS = [
    "Emoji 🙂🚀👩‍💻 and flags 🇫🇷!",
    "中文：你好，世界。日本語のテキスト、한국어 텍스트.",
    "Combining: e\u0301 a\u0308 n\u0303 — café, naïve, Ångström.",
    "mixed 🙂你\u0301 end",
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
@pytest.mark.parametrize("decode_stream", [True, False], ids=["DecodeStream", "prefix-offset"])
def test_streaming_detokenization_equals_full_decode(folders, monkeypatch, text, decode_stream):
    if not decode_stream:  # the path used with tokenizers < 0.21, where DecodeStream does not exist
        monkeypatch.setattr(tokenizer_module, "DecodeStream", None)
    tok = Tokenizer.from_pretrained(folders["plain"])
    ids = tok.encode(text)
    assert len(ids) > len(text) / 2  # tiny vocabulary: multi-byte characters span several tokens
    detok = tok.detokenizer()
    deltas = [detok.step(i) for i in ids]
    assert "".join(deltas) == detok.text == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some token ended inside a character and was held back
    assert detok.finish() == ""


def test_detokenizer_with_prompt_context_and_special_tokens(folders):
    tok = Tokenizer.from_pretrained(folders["plain"])
    prompt, completion = tok.encode("Hello 你"), tok.encode("好 world 🙂") + [tok.backend.token_to_id("<|im_end|>")]
    detok = tok.detokenizer(prompt_ids=prompt)
    streamed = "".join(detok.step(i) for i in completion)
    assert streamed == detok.text == "好 world 🙂" and detok.token_ids == completion
    keep = tok.detokenizer(skip_special_tokens=False)
    assert "".join(keep.step(i) for i in completion) == "好 world 🙂<|im_end|>"


def test_finish_flushes_an_incomplete_character(folders):
    tok = Tokenizer.from_pretrained(folders["plain"])
    ids = tok.encode("ok 🚀")
    detok = tok.detokenizer()
    partial = ids[:-1]  # the last byte of the rocket is missing
    assert "".join(detok.step(i) for i in partial) == "ok "
    assert detok.finish() == tok.decode(partial)[len("ok "):]
    assert detok.text == tok.decode(partial) and detok.text.endswith("\ufffd")


# ---- special tokens, EOS set, files


def test_eos_set_is_the_union_of_config_generation_config_and_tokenizer(folders, tmp_path):
    folder = Path(shutil.copytree(folders["chatml"], tmp_path / "t"))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    tok = Tokenizer.from_pretrained(folder)
    im_end = tok.backend.token_to_id("<|im_end|>")
    assert tok.eos_token_ids == {1, 2, 4, im_end}
    assert tok.bos_token_id == tok.backend.token_to_id("<|begin_of_text|>") == 0


def test_basic_properties(folders):
    tok = Tokenizer.from_pretrained(folders["plain"])
    assert tok.vocab_size == 384 + len(HEADER_TOKENS)
    assert tok.all_special_ids == [0, 1, 2, 3, 4, 384, 385]
    assert tok.eos_token_ids == {1}
    ids = tok.encode("def read_config(path):")
    assert "".join(tok.token_text(i) for i in ids) == "def read_config(path):"
    assert tok.token_text(3) == "<|im_end|>"
    assert tok.decode([*ids, 3]) == "def read_config(path):"
    assert tok.decode([*ids, 3], skip_special_tokens=False) == "def read_config(path):<|im_end|>"


def test_missing_tokenizer_json_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: missing file"):
        Tokenizer.from_pretrained(tmp_path)


def test_compiled_request_templates_are_a_bounded_cache_and_the_checkpoints_stay(folders):
    from engines.tokenizer import MAX_CACHED_REQUEST_TEMPLATES

    tok = Tokenizer.from_pretrained(folders["chatml"])
    msgs = [{"role": "user", "content": "hi"}]
    own = tok.apply_chat_template(msgs)
    for i in range(3 * MAX_CACHED_REQUEST_TEMPLATES):
        assert tok.apply_chat_template(msgs, chat_template=f"{i}:{{{{ messages[0].content }}}}") == f"{i}:hi"
    assert len(tok._compiled) <= MAX_CACHED_REQUEST_TEMPLATES + 1
    assert CHATML_TEMPLATE in tok._compiled and tok.apply_chat_template(msgs) == own
