"""Tokenizer of a checkpoint folder on top of the `tokenizers` library: encode/decode, the EOS set, chat
templates rendered the way transformers renders them (sandboxed jinja2), and incremental detokenisation for
streaming that never emits a broken UTF-8 character.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import tokenizers

from engines.model_config import CheckpointError

# The named special tokens transformers hands to every chat template (its `special_tokens_map`).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
MAX_CACHED_REQUEST_TEMPLATES = 16  # compiled templates a caller supplied (the checkpoint's are always kept)
# Tokens of context re-decoded before new ones so merges across the boundary (spaces, bytes) come out right.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: the prefix-offset path below serves alone
    DecodeStream = None


class ChatTemplateError(ValueError):
    """A chat template that cannot render these messages (its own `raise_exception`, or a template bug)."""


class Tokenizer:
    """One checkpoint's tokenizer: `tokenizer.json` plus `tokenizer_config.json` and the chat template."""

    def __init__(self, backend: tokenizers.Tokenizer, *, special_tokens: Mapping[str, str] | None = None,
                 chat_templates: Mapping[str, str] | None = None, extra_eos_token_ids: Iterable[int] = (),
                 path: Path | None = None):
        self.backend = backend
        self.path = path
        self.special_tokens = dict(special_tokens or {})
        self.chat_templates = dict(chat_templates or {})
        eos = set(int(i) for i in extra_eos_token_ids)
        eos_id = self._token_id(self.special_tokens.get("eos_token"))
        if eos_id is not None:
            eos.add(eos_id)
        self.eos_token_ids: set[int] = eos
        self.bos_token_id: int | None = self._token_id(self.special_tokens.get("bos_token"))
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.exists():
            raise CheckpointError(f"{tokenizer_file}: missing file (tandem needs a fast tokenizer's tokenizer.json)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises a bare Exception on a malformed file
            raise CheckpointError(f"{tokenizer_file}: cannot be read ({e})") from e
        tok_config = _read_json_object(folder / "tokenizer_config.json")
        special_tokens = {**_named_special_tokens(_read_json_object(folder / "special_tokens_map.json")),
                          **_named_special_tokens(tok_config)}
        eos_ids = [*_eos_ids(_read_json_object(folder / "config.json").get("eos_token_id")),
                   *_eos_ids(_read_json_object(folder / "generation_config.json").get("eos_token_id"))]
        return cls(backend, special_tokens=special_tokens, chat_templates=_chat_templates(folder, tok_config),
                   extra_eos_token_ids=eos_ids, path=folder)

    # ---- encode / decode

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (for logprobs); a lone byte of a multi-byte character shows as U+FFFD."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added tokens included (like `len()` of a transformers tokenizer)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def all_special_ids(self) -> list[int]:
        ids = {i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special}
        ids.update(i for i in map(self._token_id, self.special_tokens.values()) if i is not None)
        return sorted(ids)

    def detokenizer(self, skip_special_tokens: bool = True,
                    prompt_ids: list[int] | None = None) -> IncrementalDetokenizer:
        """A streaming decoder; `prompt_ids` (optional) gives the tokens before the first one to decode as context."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids)

    # ---- chat templates

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_templates)

    def apply_chat_template(self, messages: list[Mapping[str, Any]], add_generation_prompt: bool = True, *,
                            chat_template: str | None = None, tools: list[dict] | None = None,
                            documents: list[dict] | None = None, **kwargs: Any) -> str:
        """Render `messages` as transformers' `apply_chat_template(..., tokenize=False)` would.

        `chat_template` may name one of the checkpoint's templates or be a template string; extra keyword
        arguments become template variables (e.g. `enable_thinking=False`).
        """
        source = self._select_template(chat_template, tools)
        template = self._compiled.get(source)
        if template is None:
            try:
                template = _environment().from_string(source)
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from e
            if len(self._compiled) >= len(self.chat_templates) + MAX_CACHED_REQUEST_TEMPLATES:
                # a bounded cache: the checkpoint's own templates stay, the oldest request template goes
                own = set(self.chat_templates.values())
                oldest = next((k for k in self._compiled if k not in own), None)
                if oldest is not None:
                    del self._compiled[oldest]
            self._compiled[source] = template
        # Keys whose value is None are dropped, as transformers does (OpenAI clients send content=None).
        chat = [{k: v for k, v in _plain(m).items() if v is not None} for m in messages]
        variables = {**self.special_tokens, **_plain(kwargs)}
        try:
            return template.render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(str(e.message if e.message is not None else e)) from e

    def _select_template(self, chat_template: str | None, tools: list[dict] | None) -> str:
        if chat_template is not None and chat_template in self.chat_templates:
            return self.chat_templates[chat_template]
        if chat_template is not None:
            return chat_template
        if not self.chat_templates:
            raise ChatTemplateError(
                f"{self.path or 'this tokenizer'}: no chat template (none in tokenizer_config.json or "
                f"{CHAT_TEMPLATE_FILE}); send a plain completion prompt instead")
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        if len(self.chat_templates) == 1:
            return next(iter(self.chat_templates.values()))
        raise ChatTemplateError(f"several chat templates and none named 'default': {sorted(self.chat_templates)}")

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that are always whole characters.

    A trailing U+FFFD means the last token ended inside a multi-byte character: that text is held back until
    a later token completes it. `finish()` flushes whatever is still held (as the full decode would show it).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prompt_ids: list[int] | None = None):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids or [])[-_CONTEXT_TOKENS:]
        self._ids: list[int] = context
        self._emitted_upto = len(context)  # ids before this index are reflected in `text`
        self._context_len = len(context)
        self._stream = None
        if DecodeStream is not None:
            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens) if context \
                else DecodeStream(skip_special_tokens=skip_special_tokens)
        self.text = ""

    @property
    def token_ids(self) -> list[int]:
        return self._ids[self._context_len:]

    def step(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is still partial)."""
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                delta = self._stream.step(self._tokenizer.backend, token_id) or ""
            except Exception:  # e.g. "invalid prefix" from decoders that rewrite earlier text: fall back
                self._stream = None
                delta = self._decode_pending(final=False)
        else:
            delta = self._decode_pending(final=False)
        if delta:
            self._emitted_upto = len(self._ids)
            self.text += delta
        return delta

    def finish(self) -> str:
        """Flush text held back for an incomplete character at the end of the stream (may contain U+FFFD)."""
        delta = self._decode_pending(final=True) if self._emitted_upto < len(self._ids) else ""
        self._emitted_upto = len(self._ids)
        self._stream = None  # what was held is now emitted; later steps go through prefix-offset decoding
        self.text += delta
        return delta

    def _decode_pending(self, final: bool) -> str:
        # Prefix-offset decoding: decode a few already-emitted tokens with the new ones and keep the difference,
        # so byte-level merges and leading-space rules at the boundary come out as in a full decode.
        start = max(0, self._emitted_upto - _CONTEXT_TOKENS)
        prefix = self._tokenizer.decode(self._ids[start:self._emitted_upto], self._skip)
        full = self._tokenizer.decode(self._ids[start:], self._skip)
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not final):
            return ""
        return full[len(prefix):]


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _SafeNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes, so templates cannot reach interpreter internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Unlike jinja's own tojson, no HTML escaping: chat templates want the JSON verbatim.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_ENV: jinja2.sandbox.ImmutableSandboxedEnvironment | None = None


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The jinja environment transformers renders chat templates in (templates are untrusted: sandboxed)."""
    global _ENV
    if _ENV is None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["namespace"] = _SafeNamespace
        _ENV = env
    return _ENV


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types: the sandbox cannot vet methods of arbitrary objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "__struct_fields__"):  # msgspec Structs (the gateway's request models)
        return {f: _plain(getattr(value, f)) for f in value.__struct_fields__}
    return f"<{type(value).__name__}>"


def _read_json_object(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json stores a special token as a string or as an AddedToken dict {"content": ...}
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _named_special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    out = {}
    for name in NAMED_SPECIAL_TOKENS:
        content = _token_content(config.get(name))
        if content is not None:
            out[name] = content
    return out


def _chat_templates(folder: Path, tok_config: Mapping[str, Any]) -> dict[str, str]:
    """Named templates; a chat_template.jinja file wins over tokenizer_config.json, as in transformers."""
    templates: dict[str, str] = {}
    raw = tok_config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        for entry in raw:
            if isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str):
                templates[entry["name"]] = entry["template"]
            else:
                raise CheckpointError(f"{folder / 'tokenizer_config.json'}: chat_template list entries need "
                                      f"'name' and 'template' strings, found {entry!r}")
    elif raw is not None:
        raise CheckpointError(f"{folder / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                              f"{{name, template}}, found {type(raw).__name__}")
    jinja_file = folder / CHAT_TEMPLATE_FILE
    if jinja_file.exists():
        templates = {"default": jinja_file.read_text(encoding="utf-8")}
    return templates


def _eos_ids(value: Any) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int) or (isinstance(v, str) and v.isdigit())]
