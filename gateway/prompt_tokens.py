"""Chat prompts' token ids with the chat template's fixed parts encoded once: a rendered prompt is cut at the
tokenizer's added tokens, where the tokenizer itself cuts before it normalises and pre-tokenises, so each piece
encodes alone exactly as inside the whole; each piece's ids are kept in a bounded LRU (role headers,
separators, a repeated system prompt). Tokenizers for which a piece's ids could depend on its place encode whole.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from typing import Any

import tokenizers

MAX_PIECES = 4096  # cached pieces per tokenizer
MAX_PIECE_CHARS = 16384  # a longer piece is encoded each time, never kept (bounds the cache's memory)
# Pre-tokenizers that treat every piece alike wherever it starts (Metaspace too, unless prepend_scheme "first":
# that one adds its prefix to the text's first piece only, so a piece alone would gain one)
_PLACE_FREE = frozenset({"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit",
                         "BertPreTokenizer", "UnicodeScripts", "CharDelimiterSplit", "Sequence", "Metaspace"})

_ENCODERS: weakref.WeakKeyDictionary[Any, PieceEncoder] = weakref.WeakKeyDictionary()


def piece_encoder(tokenizer: Any) -> PieceEncoder:
    """The one `PieceEncoder` of `tokenizer` (made on first use)."""
    encoder = _ENCODERS.get(tokenizer)
    if encoder is None:
        encoder = _ENCODERS[tokenizer] = PieceEncoder(tokenizer)
    return encoder


class PieceEncoder:
    """`tokenizer.encode(text)` (no special tokens added) of rendered chat prompts, piece by cached piece."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._pieces: dict[str, list[int]] = {}  # insertion order is recency: the first is the next to go
        self._lock = threading.Lock()  # long prompts are prepared on the tokenisation pool's threads
        backend = getattr(tokenizer, "backend", None)
        self._cut_ids: dict[str, int] = {}
        self.exact = False  # True: pieces are cut and cached; False: every text is encoded whole
        if isinstance(backend, tokenizers.Tokenizer) and not getattr(backend, "encode_special_tokens", False):
            spec = json.loads(backend.to_str())
            # an added token that strips the spaces beside it or matches normalised text stays inside its piece
            self._cut_ids = {t["content"]: t["id"] for t in spec.get("added_tokens") or []
                             if t["content"] and not (t.get("normalized") or t.get("lstrip") or t.get("rstrip")
                                                      or t.get("single_word"))}
            self.exact = bool(self._cut_ids) and _place_free(spec.get("pre_tokenizer"))
        if self.exact:  # longest first: the tokenizer takes the longest added token at a place
            self._cut = re.compile("(" + "|".join(map(re.escape, sorted(self._cut_ids, key=len, reverse=True)))
                                   + ")")

    def encode(self, text: str) -> list[int]:
        if not self.exact:
            return self.tokenizer.encode(text)
        ids: list[int] = []
        pieces, lock, cut_ids = self._pieces, self._lock, self._cut_ids
        for i, part in enumerate(self._cut.split(text)):
            if i % 2:  # an added token (re.split puts the captured cuts at the odd places)
                ids.append(cut_ids[part])
                continue
            if not part:
                continue
            with lock:
                cached = pieces.pop(part, None)
                if cached is not None:
                    pieces[part] = cached  # now the most recent
            if cached is None:
                cached = self.tokenizer.encode(part)
                if len(part) <= MAX_PIECE_CHARS:
                    with lock:
                        if len(pieces) >= MAX_PIECES:
                            del pieces[next(iter(pieces))]
                        pieces[part] = cached
            ids.extend(cached)
        return ids


def _place_free(pre_tokenizer: dict[str, Any] | None) -> bool:
    """Whether every pre-tokenizer step treats a piece the same wherever it starts in the text."""
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind not in _PLACE_FREE:
        return False
    if kind == "Metaspace" and pre_tokenizer.get("prepend_scheme") == "first":
        return False
    return all(_place_free(step) for step in pre_tokenizer.get("pretokenizers") or [])
