"""The tokenizer a GGUF file describes in its metadata (tokenizer.ggml.*): byte-level BPE ("gpt2", with the
pre-tokenizer split of tokenizer.ggml.pre) or SentencePiece BPE ("llama", merges from the file or recovered
from the scores), control / user-defined tokens, BOS / EOS ids and `tokenizer.chat_template`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from engines.model_config import CheckpointError
from engines.tokenizer import Tokenizer

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split its merges were learned with (absent: GPT-2's own ByteLevel regex)
PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
              "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
CONTROL, USER_DEFINED = 3, 4


def field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value of a `gguf.GGUFReader`, or `default` when the file lacks it."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def tokenizer_from_gguf(reader: Any, path: Path) -> Tokenizer:
    kind = field(reader, "tokenizer.ggml.model")
    tokens = field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise CheckpointError(f"{path}: no tokenizer in the GGUF metadata (tokenizer.ggml.tokens)")
    tokens = list(tokens)
    types = list(field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = field(reader, "tokenizer.ggml.merges")
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "gpt2":
        backend = tokenizers.Tokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges or []]))
        split = PRE_SPLITS.get(field(reader, "tokenizer.ggml.pre"))
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        backend.decoder = decoders.ByteLevel()
    elif kind == "llama":
        scores = list(field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens))
        pairs = [tuple(m.split(" ", 1)) for m in merges] if merges else _merges_from_scores(vocab, scores)
        unk = field(reader, "tokenizer.ggml.unknown_token_id")
        backend = tokenizers.Tokenizer(models.BPE(vocab, pairs, unk_token=tokens[unk] if unk is not None else None,
                                                  fuse_unk=True, byte_fallback=True))
        prefix = field(reader, "tokenizer.ggml.add_space_prefix", True)
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", split=False,
                                                         prepend_scheme="first" if prefix else "never")
        backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                             decoders.Fuse(), decoders.Strip(content=" ", left=1)])
    else:
        raise CheckpointError(f"{path}: GGUF tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level "
                              "BPE), llama (SentencePiece)")
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == USER_DEFINED])
    bos, eos = field(reader, "tokenizer.ggml.bos_token_id"), field(reader, "tokenizer.ggml.eos_token_id")
    add_bos = field(reader, "tokenizer.ggml.add_bos_token", kind == "llama")
    if add_bos and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)])
    special = {name: tokens[i] for name, i in (("bos_token", bos), ("eos_token", eos),
                                              ("pad_token", field(reader, "tokenizer.ggml.padding_token_id")),
                                              ("unk_token", field(reader, "tokenizer.ggml.unknown_token_id")))
               if i is not None and 0 <= i < len(tokens)}
    template = field(reader, "tokenizer.chat_template")
    return Tokenizer(backend, special_tokens=special, chat_templates={"default": template} if template else {},
                     extra_eos_token_ids=[eos] if eos is not None else [], path=path)


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece files carry scores, not merges: every split of a token into two tokens is a merge, ranked
    by the merged token's score (best first), ties by the longer left then right piece, then token order (the
    ranking transformers' GGUF loader gives the same vocabulary)."""
    ranked = []
    for token, i in vocab.items():
        local = [(token[:cut], token[cut:]) for cut in range(1, len(token))
                 if token[:cut] in vocab and token[cut:] in vocab]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((scores[i], left, right) for left, right in local)
    ranked.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in ranked]
