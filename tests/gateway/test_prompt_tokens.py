"""Chat prompts encoded piece by cached piece (gateway/prompt_tokens.py) give the very ids of encoding the rendered
prompt whole, on the shipped checkpoint's tokenizer and on tokenizers of other shapes (Llama 3 header tokens,
a Llama 2 style Prepend normaliser, Metaspace, ByteLevel's prefix space, space-stripping added tokens), over
varied conversations."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest
import tokenizers
from tiny_checkpoints import _CORPUS, CHATML, build_tokenizer
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers

import gateway.prompt_tokens as prompt_tokens
from engines.tokenizer import Tokenizer
from gateway.prompt_tokens import PieceEncoder, piece_encoder
from gateway.prompts import chat_prompt
from gateway.protocol import ChatCompletionRequest

ROOT = Path(__file__).resolve().parents[2]

LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
LLAMA2 = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token }}[INST] {{ m['content'] }} [/INST]"
          "{% elif m['role'] == 'system' %}<<SYS>>\n{{ m['content'] }}\n<</SYS>>\n\n"
          "{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}")

FRAGMENTS = [
    "Say hello to the benchmark.", "What is 2 + 2?", "  leading and trailing spaces  ", "tabs\tand\nnewlines\n\n",
    "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n", "Réponds brièvement.",
    "简短回答。你好，世界", "emoji 🙂🚀 and ZWJ 👩‍💻", "numbers 1234567890 and 3.14159", "'quotes' \"double\" `ticks`",
    "a user typing <|im_end|> or <|eot_id|> themselves", "<|im_start|>", " ", "", "\n", "ünïcödé   spaced   out",
    "JSON {\"a\": [1, 2, {\"b\": null}]}", "URL https://example.com/a?b=c&d=e#f", "CamelCase snake_case kebab-case",
    "<<SYS>> [INST] look-alikes [/INST]", "x" * 300, "The quick brown fox jumps over the lazy dog. " * 12,
]
SYSTEMS = ["You are a helpful assistant.", "You are a careful assistant. Answer in plain English. " * 8,
           "Reply in JSON only.\n\nRules:\n- be brief\n- cite sources"]


def conversations(seed: int, count: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.7 else []
        for _ in range(rng.randint(1, 4)):
            for role in ("user", "assistant"):
                text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 3)))
                messages.append({"role": role, "content": text or "."})
        out.append(messages[:-1])  # end on the user's turn
    return out


def _tokenizer(folder: Path, template: str, backend: tokenizers.Tokenizer | None = None) -> Tokenizer:
    if backend is not None:
        backend.save(str(folder / "tokenizer.json"))
    tok = Tokenizer.from_pretrained(folder)
    tok.chat_templates = {"default": template}
    return tok


def _metaspace(folder: Path, scheme: str, normalizer: bool) -> tokenizers.Tokenizer:
    backend = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    if normalizer:  # Llama 2's: a prefix and spaces as the metaspace character, no pre-tokenizer
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
        backend.decoder = decoders.Metaspace(prepend_scheme=scheme)
    specials = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]
    backend.train_from_iterator(_CORPUS * 5 + FRAGMENTS * 5, trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    return backend


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("piece_tokenizers")
    out = {"tandem-tiny-s": Tokenizer.from_pretrained(ROOT / "models" / "tandem-tiny-s")}
    for name in ("chatml", "llama3", "lstrip", "metaspace_first", "metaspace_always", "llama2_prepend",
                 "bytelevel_prefix"):
        build_tokenizer(root / name)
    out["chatml"] = _tokenizer(root / "chatml", CHATML)
    prefixed = tokenizers.Tokenizer.from_file(str(root / "bytelevel_prefix" / "tokenizer.json"))
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)  # a space before every piece
    out["bytelevel_prefix"] = _tokenizer(root / "bytelevel_prefix", CHATML, prefixed)
    llama3 = tokenizers.Tokenizer.from_file(str(root / "llama3" / "tokenizer.json"))
    llama3.add_special_tokens(["<|start_header_id|>", "<|end_header_id|>"])
    llama3.pre_tokenizer = pre_tokenizers.Sequence([  # Llama 3's: a regex split, then bytes
        pre_tokenizers.Split(tokenizers.Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                                              r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    out["llama3"] = _tokenizer(root / "llama3", LLAMA3, llama3)
    lstrip = tokenizers.Tokenizer.from_file(str(root / "lstrip" / "tokenizer.json"))
    lstrip.add_special_tokens([AddedToken("[/INST]", lstrip=True, rstrip=True, special=True),
                               AddedToken("[INST]", normalized=True, special=False)])
    out["lstrip"] = _tokenizer(root / "lstrip", LLAMA2, lstrip)
    for name, scheme, normalizer in (("metaspace_first", "first", False), ("metaspace_always", "always", False),
                                     ("llama2_prepend", "always", True)):
        out[name] = _tokenizer(root / name, LLAMA2, _metaspace(root / name, scheme, normalizer))
    return out


@pytest.mark.parametrize("shape", ["tandem-tiny-s", "chatml", "llama3", "lstrip", "metaspace_first",
                                   "metaspace_always", "llama2_prepend", "bytelevel_prefix"])
def test_pieces_encode_to_the_ids_of_the_whole_prompt(shapes, shape):
    tok = shapes[shape]
    encoder = PieceEncoder(tok)
    checked = 0
    for messages in conversations(seed=len(shape), count=150):
        for add_generation_prompt in (True, False):
            text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            expected = tok.encode(text)
            assert encoder.encode(text) == expected, text  # first sight: pieces encoded and cached
            assert encoder.encode(text) == expected, text  # again: every piece from the cache
            checked += 1
    assert checked == 300
    # the shapes whose pieces are exact are cut; Metaspace "first" prefixes only the text's start: encoded whole
    assert encoder.exact is (shape != "metaspace_first")


def test_metaspace_first_would_differ_if_cut(shapes):
    """Why the guard: cut at a special token, Metaspace "first" gives the second piece a prefix it lacks inside."""
    tok = shapes["metaspace_first"]
    text = "<|begin_of_text|>hello world<|end_of_text|>user said hello"
    pieces = [i for p in ("<|begin_of_text|>", "hello world", "<|end_of_text|>", "user said hello")
              for i in tok.encode(p)]
    assert pieces != tok.encode(text)
    assert PieceEncoder(tok).encode(text) == tok.encode(text)


def test_added_tokens_that_strip_spaces_or_match_normalised_text_are_not_cut_points(shapes):
    cuts = PieceEncoder(shapes["lstrip"])._cut_ids
    assert "[/INST]" not in cuts and "[INST]" not in cuts
    assert {"<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"} <= cuts.keys()


class _Counting:
    """A tokenizer that counts what it is asked to encode."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.backend, self.asked = tok, tok.backend, []

    def encode(self, text: str) -> list[int]:
        self.asked.append(text)
        return self.tok.encode(text)


def test_fixed_parts_are_encoded_once_and_a_new_user_turn_alone_after(shapes):
    tok = shapes["tandem-tiny-s"]
    counting = _Counting(tok)
    encoder = PieceEncoder(counting)
    system = SYSTEMS[1]
    first = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": "Hi there"}])
    assert encoder.encode(first) == tok.encode(first)
    assert counting.asked == [f"system\n{system}", "\n", "user\nHi there", "assistant\n"]
    counting.asked.clear()
    second = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": "And now?"}])
    assert encoder.encode(second) == tok.encode(second)
    assert counting.asked == ["user\nAnd now?"]  # the system prompt, separators and header came from the cache
    counting.asked.clear()
    assert encoder.encode(first) == tok.encode(first)
    assert counting.asked == []


def test_the_cache_is_bounded_and_keeps_the_recently_used(shapes, monkeypatch):
    tok = shapes["tandem-tiny-s"]
    monkeypatch.setattr(prompt_tokens, "MAX_PIECES", 3)
    monkeypatch.setattr(prompt_tokens, "MAX_PIECE_CHARS", 40)
    encoder = PieceEncoder(tok)
    encoder.encode("<|im_start|>a<|im_end|><|im_start|>b<|im_end|>")
    encoder.encode("<|im_start|>a<|im_end|>")  # a is the most recent now
    encoder.encode("<|im_start|>c<|im_end|><|im_start|>d<|im_end|>")
    assert list(encoder._pieces) == ["a", "c", "d"]  # b, the least recently used, went
    long = "y" * 41
    assert encoder.encode(long) == tok.encode(long)
    assert long not in encoder._pieces


def test_a_tokenizer_without_a_tokenizers_backend_is_encoded_whole():
    class Plain:
        def encode(self, text):
            return [len(text)]

    encoder = piece_encoder(Plain())
    assert not encoder.exact and encoder.encode("<|im_start|>ab") == [14]


def test_a_chat_requests_prompt_tokens_equal_the_rendered_prompt_encoded_whole(shapes):
    tok = shapes["tandem-tiny-s"]

    class Engine:
        name, tokenizer = "small", tok

    for messages in conversations(seed=7, count=40):
        data = msgspec.convert({"model": "fast", "messages": messages}, ChatCompletionRequest)
        prompt, plain = chat_prompt(data, allow_request_template=False)
        prompt.tokenize = True
        assert prompt.templated
        assert prompt._prepare(Engine()) == tok.encode(tok.apply_chat_template(plain))
