"""Router features: hashed character n-grams of the prompt's tail (and, for the cascade's escalation scorer, of
the small model's answer), cheap text statistics, and named extra numbers a caller supplies.

The n-gram blocks are exactly scikit-learn's `HashingVectorizer(analyzer="char", alternate_sign=True,
norm="l2", lowercase=False)`: murmurhash3 of each n-gram, stable across processes and machines. Training
vectorises with `HashingVectorizer.transform` in bulk; a single request goes through `hash_block`, which builds
the same vector in one C pass (router_model.native), or in numpy where the helper cannot be built, without the
vectorizer's per-call validation and sparse-matrix overhead (tests/router_model check all three agree bit for
bit).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

import router_model.native as native

# One prompt: a plain string (one user turn) or OpenAI-style messages.
Conversation = str | Sequence[Mapping[str, Any]]

STAT_NAMES: tuple[str, ...] = (
    "log_chars", "log_words", "log_lines", "log_last_message_chars", "mean_word_len", "log_mean_line_len",
    "log_max_line_len", "digit_ratio", "punct_ratio", "upper_ratio", "space_ratio", "non_ascii_ratio",
    "indented_line_ratio", "blank_line_ratio", "comment_line_ratio", "keyword_ratio", "bracket_ratio",
    "quote_ratio", "question_ratio", "log_turns", "user_turns", "assistant_turns", "has_system",
    "last_message_share",
    # where the conversation stops: what comes next depends most on the last line
    "ends_mid_line", "log_last_line_len", "last_line_indent", "last_line_is_comment", "inside_triple_quote",
)
# The small model's prefill of the prompt (computed by router_model/prompt_stats.py).
TAIL = 16  # the prompt's last tokens: what the next line depends on most
PROMPT_EXTRAS: dict[str, str] = {
    "small_prompt_logprob": "mean token log-probability of the prompt under the small model",
    "small_prompt_min_logprob": "minimum token log-probability of the prompt under the small model",
    "small_prompt_tail_logprob": f"mean token log-probability of the prompt's last {TAIL} tokens",
    "small_prompt_last_logprob": "log-probability of the prompt's last token",
    "small_prompt_tail_entropy": f"mean next-token entropy (nats) over the prompt's last {TAIL} positions",
    "small_next_entropy": "entropy (nats) of the small model's next-token distribution right after the prompt",
}
# Extra features a caller supplies per request: the small model's prefill, or (for the escalation scorer)
# the statistics of the small answer's token logprobs (router_model.scoring.answer_stats).
KNOWN_EXTRAS: dict[str, str] = {
    **PROMPT_EXTRAS,  # the small model's prefill of the prompt (router_model/prompt_stats.py)
    "answer_mean_logprob": "mean chosen-token logprob of the small answer",
    "answer_min_logprob": "minimum chosen-token logprob of the small answer",
    "answer_first_line_logprob": "mean chosen-token logprob over the small answer's first line",
    "answer_entropy": "mean next-token entropy of the small answer (estimated from the top logprobs)",
    "answer_log_tokens": "log(1 + tokens of the small answer)",
}
# what a hashed block reads: the end of the flattened conversation, or the small model's answer
VIEWS = ("tail", "answer")
MAX_STATS_CHARS = 2048  # ratios look at the last characters only; lengths stay exact

_CODE_KEYWORDS = frozenset(
    "def class return import from if elif else for while try except finally with as lambda yield raise "
    "assert pass break continue not and or in is none true false self async await global nonlocal del "
    "function var let const int void public private static struct include fn impl match".split()
)
_WORD_RE = re.compile(r"\w+")  # punctuation is left to the character n-grams
_CODE_KEYWORD_BYTES = frozenset(w.encode("ascii") for w in _CODE_KEYWORDS)
# ASCII bytes -> what `\w+` over the lowered text sees: word characters lowered, every other byte a space
_ASCII_WORD_BYTES = bytes(c if chr(c).isalnum() or c == ord("_") else ord(" ")
                          for c in range(128)).lower() + b" " * 128
# str.split()'s white space by code point (none lies above U+3000; the last slot stands for all of those)
_IS_SPACE = np.array([chr(c).isspace() for c in range(0x3001)] + [False])

# Character classes, counted with one bincount over a lookup table (code points >= 128 share the last slot).
_OTHER, _DIGIT, _UPPER, _SPACE, _BRACKET, _QUOTE, _QUESTION, _PUNCT, _NEWLINE, _NON_ASCII = range(10)
_NUM_CLASSES = 10
_CHAR_CLASS = np.zeros(129, dtype=np.int64)
_CHAR_CLASS[ord("0"):ord("9") + 1] = _DIGIT
_CHAR_CLASS[ord("A"):ord("Z") + 1] = _UPPER
_CHAR_CLASS[[ord(" "), ord("\t")]] = _SPACE
_CHAR_CLASS[[ord(c) for c in "!#$%&*+,-./:;<=>@\\^_|~"]] = _PUNCT
_CHAR_CLASS[[ord(c) for c in "()[]{}"]] = _BRACKET
_CHAR_CLASS[[ord(c) for c in "'\"`"]] = _QUOTE
_CHAR_CLASS[ord("?")] = _QUESTION
_CHAR_CLASS[ord("\n")] = _NEWLINE
_CHAR_CLASS[128] = _NON_ASCII


@dataclass(frozen=True)
class HashBlock:
    """One HashingVectorizer block: char n-grams of the last `chars` characters of a view (0: all of it)."""

    view: str = "tail"
    chars: int = 300
    ngrams: tuple[int, int] = (1, 5)
    buckets: int = 1 << 16

    def __post_init__(self) -> None:
        if self.view not in VIEWS:
            raise ValueError(f"unknown view {self.view!r}; known: {', '.join(VIEWS)}")
        lo, hi = self.ngrams
        if not 1 <= lo <= hi <= 8:
            raise ValueError(f"ngrams={self.ngrams} must satisfy 1 <= low <= high <= 8")
        if self.chars < 0 or self.buckets < 2:
            raise ValueError("chars must be >= 0 and buckets >= 2")

    def vectorizer(self):
        from sklearn.feature_extraction.text import HashingVectorizer

        return HashingVectorizer(analyzer="char", ngram_range=tuple(self.ngrams), n_features=self.buckets,
                                 alternate_sign=True, norm="l2", lowercase=False, dtype=np.float64)

    def cut(self, text: str) -> str:
        return text[-self.chars:] if self.chars else text


DEFAULT_BLOCKS = (HashBlock("tail", 60, (1, 5), 1 << 16), HashBlock("tail", 300, (2, 5), 1 << 17))


@dataclass(frozen=True)
class FeatureConfig:
    """Everything that fixes the meaning of a feature vector; saved in the artifact and checked on load."""

    blocks: tuple[HashBlock, ...] = DEFAULT_BLOCKS
    stats: tuple[str, ...] = STAT_NAMES
    extras: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(b if isinstance(b, HashBlock) else HashBlock(**b)
                                                 for b in self.blocks))
        unknown = [s for s in self.stats if s not in STAT_NAMES]
        if unknown:
            raise ValueError(f"unknown statistic(s) {unknown}; known: {', '.join(STAT_NAMES)}")
        bad = [e for e in self.extras if e not in KNOWN_EXTRAS]
        if bad:
            raise ValueError(f"unknown extra feature(s) {bad}; known: {', '.join(KNOWN_EXTRAS)}")

    @property
    def num_dense(self) -> int:
        return len(self.stats) + len(self.extras)

    @property
    def num_hashed(self) -> int:
        return sum(b.buckets for b in self.blocks)

    @property
    def needs_answer(self) -> bool:
        return any(b.view == "answer" for b in self.blocks)

    def to_dict(self) -> dict[str, Any]:
        return {"blocks": [{"view": b.view, "chars": b.chars, "ngrams": list(b.ngrams), "buckets": b.buckets}
                           for b in self.blocks],
                "stats": list(self.stats), "extras": list(self.extras)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FeatureConfig:
        extra = set(d) - {"blocks", "stats", "extras"}
        if extra:
            raise ValueError(f"feature config has unknown field(s) {sorted(extra)}")
        blocks = []
        for b in d.get("blocks", ()):
            unknown = set(b) - {"view", "chars", "ngrams", "buckets"}
            if unknown:
                raise ValueError(f"hash block has unknown field(s) {sorted(unknown)}")
            blocks.append(HashBlock(view=b["view"], chars=int(b["chars"]), ngrams=tuple(b["ngrams"]),
                                    buckets=int(b["buckets"])))
        return cls(blocks=tuple(blocks), stats=tuple(d.get("stats", ())), extras=tuple(d.get("extras", ())))


@dataclass
class PromptFeatures:
    """One prompt's features: a dense part (stats then extras) and a sparse hashed part (indices, values)."""

    dense: np.ndarray  # float64 [num_dense]
    indices: np.ndarray  # int64, into the hashed space [0, num_hashed) (blocks in order)
    values: np.ndarray  # float64, same length as indices
    extras_missing: list[str] = field(default_factory=list)


def normalize_conversation(x: Conversation) -> list[tuple[str, str]]:
    """A string or OpenAI-style messages -> [(role, text)]; list-of-parts content keeps its text parts."""
    if isinstance(x, str):
        return [("user", x)]
    turns = []
    for i, message in enumerate(x):
        if not isinstance(message, Mapping):
            raise TypeError(f"message {i} must be a mapping with 'role' and 'content', got {type(message).__name__}")
        role = str(message.get("role", "user"))
        content = message.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:  # [{"type": "text", "text": ...}, {"type": "image_url", ...}]
            text = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        turns.append((role, text))
    return turns



def flatten(turns: list[tuple[str, str]]) -> str:
    """The text the tail blocks read: a plain prompt as is; messages as role-marked turns."""
    if len(turns) == 1 and turns[0][0] == "user":
        return turns[0][1]
    return "".join(f"\x02{role}\x03{text}" for role, text in turns)


_WHITE_SPACES = re.compile(r"\s\s+")  # what the char analyzer collapses to one space (sklearn's own pattern)
_C1, _C2 = np.uint32(0xCC9E2D51), np.uint32(0x1B873593)


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


@lru_cache(maxsize=2048)
def _windows(length: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every char n-gram window of a `length`-byte text (n in lo..hi): the byte positions [T, 8] (clipped),
    the mask of bytes inside the window [T, 8] and n [T]."""
    ns = list(range(lo, min(hi, length) + 1))
    starts = np.concatenate([np.arange(length - n + 1) for n in ns]) if ns else np.zeros(0, np.int64)
    lens = np.concatenate([np.full(length - n + 1, n) for n in ns]) if ns else np.zeros(0, np.int64)
    j = np.arange(8)
    pos = np.minimum(starts[:, None] + j, max(length - 1, 0))
    return pos, j[None, :] < lens[:, None], lens.astype(np.uint32)


def _mix(k: np.ndarray) -> np.ndarray:
    return _rotl(k * _C1, 15) * _C2


def _murmur_ngrams(b: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """murmurhash3_x86_32 (seed 0, signed) of every n-gram (n in lo..hi <= 8 bytes) of `b`, all at once."""
    pos, inside, ns = _windows(b.size, lo, hi)
    if ns.size == 0:
        return np.zeros(0, np.int64)
    w = np.ascontiguousarray(np.where(inside, b[pos], 0).astype(np.uint8)).view("<u4")  # [T, 2] words
    w0, w1 = w[:, 0], w[:, 1]
    nb = ns >> np.uint32(2)
    h = np.zeros(ns.size, np.uint32)
    step = np.uint32(0xE6546B64)
    h = np.where(nb >= 1, _rotl(h ^ _mix(w0), 13) * np.uint32(5) + step, h)
    h = np.where(nb >= 2, _rotl(h ^ _mix(w1), 13) * np.uint32(5) + step, h)
    h ^= _mix(np.where(nb == 0, w0, np.where(nb == 1, w1, np.uint32(0))))  # the tail (bytes past n are 0)
    h ^= ns
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h.view(np.int32).astype(np.int64)


def _char_ngram_hashes(text: str, ngrams: tuple[int, int]) -> np.ndarray | None:
    """The murmurhash3 of every char n-gram the analyzer would produce, for ASCII text (None otherwise: there a
    character is not one byte)."""
    if not text.isascii():
        return None
    b = np.frombuffer(_WHITE_SPACES.sub(" ", text).encode("ascii"), dtype=np.uint8)
    return _murmur_ngrams(b, *ngrams)


def _collapsed_utf8(text: str) -> tuple[bytes, int] | None:
    """What the char analyzer hashes: white space runs as one space, as (UTF-8 bytes, characters); None for a
    text with a lone surrogate, which the reference path rejects as scikit-learn does."""
    collapsed = _WHITE_SPACES.sub(" ", text)
    try:
        return collapsed.encode("utf-8"), len(collapsed)
    except UnicodeEncodeError:
        return None


def hash_block(analyzer, text: str, buckets: int, ngrams: tuple[int, int] | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """(sorted indices, values) equal to HashingVectorizer(analyzer=..., n_features=buckets,
    alternate_sign=True, norm="l2").transform([text]) for one document. With `ngrams` given, the C helper
    (router_model.native) hashes the text in one pass; without it, `hash_block_numpy`."""
    data = _collapsed_utf8(text) if ngrams is not None and native.hash_block_fn() is not None else None
    if data is None:
        return hash_block_numpy(analyzer, text, buckets, ngrams)
    return native.hash_blocks([data], [(*ngrams, buckets, 0)])


def hash_block_numpy(analyzer, text: str, buckets: int, ngrams: tuple[int, int] | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """`hash_block` in numpy: ASCII text by the vectorised murmurhash3 above (~5x faster than one call per
    n-gram), other text n-gram by n-gram with `sklearn.utils.murmurhash3_32`."""
    h = _char_ngram_hashes(text, ngrams) if ngrams is not None else None
    if h is None:
        from sklearn.utils import murmurhash3_32

        grams = analyzer(text)
        h = np.fromiter((murmurhash3_32(g, 0) for g in grams), dtype=np.int64, count=len(grams))
    if h.size == 0:
        return np.zeros(0, np.int64), np.zeros(0)
    idx = np.abs(h) % buckets
    sign = np.where(h >= 0, 1.0, -1.0)
    uniq, inv = np.unique(idx, return_inverse=True)
    vals = np.bincount(inv, weights=sign, minlength=uniq.size)
    keep = vals != 0
    uniq, vals = uniq[keep], vals[keep]
    norm = np.sqrt(np.dot(vals, vals))
    return uniq, (vals / norm if norm > 0 else vals)


def _clip_turns(turns: list[tuple[str, str]], max_chars: int) -> list[tuple[str, str]]:
    """The last `max_chars` characters of the conversation, as turns (the most recent context matters most)."""
    out: list[tuple[str, str]] = []
    budget = max_chars
    for role, text in reversed(turns):
        if budget <= 0:
            break
        out.append((role, text[-budget:]))
        budget -= len(text) + 1
    return out[::-1]


class Featurizer:
    """Turns a conversation (and, for an escalation scorer, the small answer) into `PromptFeatures`."""

    def __init__(self, config: FeatureConfig | None = None):
        self.config = config or FeatureConfig()
        self._stat_pos = [STAT_NAMES.index(s) for s in self.config.stats]
        self._all_stats = self._stat_pos == list(range(len(STAT_NAMES)))
        offsets = np.cumsum([0] + [b.buckets for b in self.config.blocks])
        self._offsets = [int(o) for o in offsets[:-1]]
        self._native_blocks = [(*b.ngrams, b.buckets, off) for b, off in zip(self.config.blocks, self._offsets)]

    @cached_property
    def vectorizers(self) -> list:
        return [b.vectorizer() for b in self.config.blocks]

    @cached_property
    def _analyzers(self) -> list:
        return [v.build_analyzer() for v in self.vectorizers]

    def warm(self) -> None:
        """Build what the first request would otherwise pay for: the C helper, or where it cannot be built the
        scikit-learn analyzers of the numpy path. With the helper, scikit-learn (1.2-1.5 s to import, most of a
        server's start-up) is imported only for a text the helper refuses (a lone surrogate, which scikit-learn
        refuses too, and which no JSON request body can carry)."""
        if native.hash_block_fn() is None:
            self._analyzers  # noqa: B018

    def __call__(self, x: Conversation, extras: Mapping[str, float] | None = None,
                 answer: str | None = None) -> PromptFeatures:
        cfg = self.config
        turns = normalize_conversation(x)
        views = {"tail": flatten(turns), "answer": answer or ""}
        extra_vals, missing = self._extras(extras)
        dense = np.concatenate([self.stats_of(turns), extra_vals])
        indices, values = self._hashed([block.cut(views[block.view]) for block in cfg.blocks])
        return PromptFeatures(dense=dense, indices=indices, values=values, extras_missing=missing)

    def _hashed(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The hashed blocks of one request, concatenated: one C call a block into one buffer where it can."""
        if native.hash_block_fn() is not None:
            data = [_collapsed_utf8(t) for t in texts]
            if None not in data:
                return native.hash_blocks(data, self._native_blocks)
        parts = [hash_block_numpy(analyzer, text, block.buckets, block.ngrams)
                 for block, analyzer, text in zip(self.config.blocks, self._analyzers, texts)]
        if not parts:
            return np.zeros(0, np.int64), np.zeros(0)
        return (np.concatenate([i + off for (i, _), off in zip(parts, self._offsets)]),
                np.concatenate([v for _, v in parts]))

    def _extras(self, extras: Mapping[str, float] | None) -> tuple[np.ndarray, list[str]]:
        vals = np.zeros(len(self.config.extras))
        missing = []
        for i, name in enumerate(self.config.extras):
            value = None if extras is None else extras.get(name)
            if value is None:
                missing.append(name)
            else:
                vals[i] = float(value)
        return vals, missing

    def stats_of(self, turns: list[tuple[str, str]]) -> np.ndarray:
        if not self._stat_pos:
            return np.zeros(0)
        body = "\n".join(text for _, text in _clip_turns(turns, MAX_STATS_CHARS))
        stats = _stats(turns, body)
        return stats if self._all_stats else stats[self._stat_pos]

    def transform(self, convs: Sequence[Conversation], extras: Sequence[Mapping[str, float] | None] | None = None,
                  answers: Sequence[str | None] | None = None):
        """(dense [n, num_dense], hashed CSR [n, num_hashed]) for many prompts, with HashingVectorizer in bulk."""
        import scipy.sparse as sp

        n = len(convs)
        extras = extras if extras is not None else [None] * n
        answers = answers if answers is not None else [None] * n
        turns = [normalize_conversation(x) for x in convs]
        views = {"tail": [flatten(t) for t in turns], "answer": [a or "" for a in answers]}
        dense = np.zeros((n, self.config.num_dense))
        for i in range(n):
            vals, missing = self._extras(extras[i])
            if missing:
                raise ValueError(f"example {i}: extra feature(s) {missing} missing from its 'extras'")
            dense[i] = np.concatenate([self.stats_of(turns[i]), vals])
        blocks = [v.transform([b.cut(t) for t in views[b.view]]) for b, v in zip(self.config.blocks, self.vectorizers)]
        hashed = sp.hstack(blocks, format="csr") if blocks else sp.csr_matrix((n, 0))
        return dense, hashed


# the statistics that are log(1 + x) of a count or length; taken with math.log1p (the C library's), not
# numpy's, whose SIMD paths differ by an ulp between CPUs (AVX-512 against AVX2), so the features, and the
# router's decisions, are the same on every machine
_LOG_STATS = np.array([STAT_NAMES.index(s) for s in (
    "log_chars", "log_words", "log_lines", "log_last_message_chars", "log_mean_line_len", "log_max_line_len",
    "log_turns", "log_last_line_len", "last_line_indent")])


def _count_words(codes: np.ndarray) -> int:
    """len(text.split()) from the text's code points: the non-space characters that start it or follow a space
    (no allocation per word: a long prompt costs a few array passes)."""
    if codes.size == 0:
        return 0
    space = _IS_SPACE.take(codes, mode="clip")
    return int(not space[0]) + int(np.count_nonzero(space[:-1] > space[1:]))


def _words(body: str) -> tuple[int, int, int]:
    """(words, their characters, code keywords among them) of `body`'s lowered text, words being `\\w+` runs.
    ASCII text (the common case) goes through bytes.translate and split, several times faster than the regex."""
    if body.isascii():
        kept = body.encode("ascii").translate(_ASCII_WORD_BYTES)
        words = kept.split()
        return len(words), len(kept) - kept.count(b" "), sum(map(_CODE_KEYWORD_BYTES.__contains__, words))
    words = _WORD_RE.findall(body.lower())  # the newlines between turns end words as the turns' ends do
    return len(words), sum(map(len, words)), sum(map(_CODE_KEYWORDS.__contains__, words))


def _stats(turns: list[tuple[str, str]], body: str) -> np.ndarray:
    """STAT_NAMES of a conversation: lengths and turn counts from all of it; ratios from the clipped tail `body`
    (its turns joined by newlines). Plain Python on strings but for one bincount of the character classes."""
    n = max(len(body), 1)
    total_chars = sum(len(t) for _, t in turns) + max(len(turns) - 1, 0)
    total_lines = sum(t.count("\n") for _, t in turns) + max(len(turns), 1)
    if len(body) == total_chars:  # not clipped: the body is the whole conversation (newlines split words too)
        total_words = len(body.split())
    else:
        total_words = _count_words(np.frombuffer("\n".join(t for _, t in turns).encode("utf-32-le"), np.uint32))
    codes = np.frombuffer(body.encode("utf-32-le"), dtype=np.uint32)
    counts = np.bincount(_CHAR_CLASS.take(codes, mode="clip"), minlength=_NUM_CLASSES).tolist()
    lines = body.split("\n")
    # the first character of each line ("\n" for an empty one); a trailing newline starts no line
    heads = "".join([line[:1] or "\n" for line in lines])[:len(lines) - (not lines[-1])]
    num_lines = max(len(heads), 1)
    num_words, word_chars, keywords = _words(body)
    roles = [r for r, _ in turns]
    last_chars = len(turns[-1][1]) if turns else 0
    punct = counts[_BRACKET] + counts[_QUOTE] + counts[_QUESTION] + counts[_PUNCT]
    last_line = lines[-1]
    stripped = last_line.lstrip(" \t")
    # an odd number of triple quotes so far: the conversation stops inside a docstring or long string
    triple = (body.count('"""') + body.count("'''")) % 2
    out = np.array([
        total_chars,
        total_words,
        total_lines,
        last_chars,
        word_chars / num_words if num_words else 0.0,
        len(body) / len(lines),
        max(map(len, lines)),
        counts[_DIGIT] / n,
        punct / n,
        counts[_UPPER] / n,
        counts[_SPACE] / n,
        counts[_NON_ASCII] / n,
        (heads.count(" ") + heads.count("\t")) / num_lines,
        heads.count("\n") / num_lines,
        (heads.count("#") + heads.count("/")) / num_lines,  # '#' or '//' comments
        keywords / max(num_words, 1),
        counts[_BRACKET] / n,
        counts[_QUOTE] / n,
        counts[_QUESTION] / num_lines,
        len(turns),
        roles.count("user"),
        roles.count("assistant"),
        "system" in roles or "developer" in roles,
        last_chars / max(total_chars, 1),
        bool(last_line),
        len(last_line),
        len(last_line) - len(stripped),
        stripped.startswith(("#", "//")),
        triple,
    ], dtype=np.float64)
    out[_LOG_STATS] = [math.log1p(x) for x in out[_LOG_STATS].tolist()]
    return out
