"""Prompt features for the router: cheap text statistics plus signed hashed word and character n-grams.

Owns the conversation flattening (every message, roles marked), the stable numpy hashing (no Python `hash()`,
so a feature index is the same in every process) and the optional extra features a caller fills in.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

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
# Extra features a caller may supply per request (the gateway fills them from the small engine's prefill).
KNOWN_EXTRAS: dict[str, str] = {
    "small_prompt_logprob": "mean token log-probability of the prompt under the small model",
}

_CODE_KEYWORDS = frozenset(
    "def class return import from if elif else for while try except finally with as lambda yield raise "
    "assert pass break continue not and or in is none true false self async await global nonlocal del "
    "function var let const int void public private static struct include fn impl match".split()
)
_WORD_RE = re.compile(r"\w+")  # punctuation is left to the character n-grams

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

_ORDER_SALT = [np.uint64((n * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) for n in range(9)]
_CHAR_MULT = np.uint64(0x100000001B3)


@dataclass(frozen=True)
class FeatureConfig:
    """Everything that fixes the meaning of a feature vector; saved in the artifact and checked on load."""

    word_buckets: int = 1 << 16
    char_buckets: int = 1 << 16
    word_ngrams: tuple[int, int] = (1, 2)
    char_ngrams: tuple[int, int] = (3, 5)
    max_chars: int = 2048  # hashing and ratios look at the last max_chars characters; lengths stay exact
    tail_chars: int = 64  # the last characters get their own char n-grams too (0: off)
    stats: tuple[str, ...] = STAT_NAMES
    extras: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = [s for s in self.stats if s not in STAT_NAMES]
        if unknown:
            raise ValueError(f"unknown statistic(s) {unknown}; known: {', '.join(STAT_NAMES)}")
        bad = [e for e in self.extras if e not in KNOWN_EXTRAS]
        if bad:
            raise ValueError(f"unknown extra feature(s) {bad}; known: {', '.join(KNOWN_EXTRAS)}")
        for name, (lo, hi) in (("word_ngrams", self.word_ngrams), ("char_ngrams", self.char_ngrams)):
            if not 1 <= lo <= hi <= 8:
                raise ValueError(f"{name}={(lo, hi)} must satisfy 1 <= low <= high <= 8")
        if not 0 <= self.tail_chars <= self.max_chars:
            raise ValueError(f"tail_chars={self.tail_chars} must be between 0 and max_chars={self.max_chars}")

    @property
    def num_dense(self) -> int:
        return len(self.stats) + len(self.extras)

    @property
    def num_hashed(self) -> int:
        return self.word_buckets + self.char_buckets

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FeatureConfig:
        known = {f for f in cls.__dataclass_fields__}
        extra = set(d) - known
        if extra:
            raise ValueError(f"feature config has unknown field(s) {sorted(extra)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


@dataclass
class PromptFeatures:
    """One prompt's features: a dense part (stats then extras) and a sparse hashed part (indices, values)."""

    dense: np.ndarray  # float64 [num_dense]
    indices: np.ndarray  # int64, sorted, into the hashed space [0, word_buckets + char_buckets)
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


_WORD_HASHES: dict[str, int] = {}


def _word_hash(word: str) -> int:
    """crc32 of the UTF-8 word, memoised (a bounded vocabulary; the cache is cleared when it grows large)."""
    h = _WORD_HASHES.get(word)
    if h is None:
        if len(_WORD_HASHES) > 500_000:
            _WORD_HASHES.clear()
        h = _WORD_HASHES[word] = zlib.crc32(word.encode("utf-8"))
    return h


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a stable, well-spread 64-bit hash of each uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _hashed_part(word_hashes: list[np.ndarray], char_hashes: list[np.ndarray], word_buckets: int,
                 char_buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """Signed feature hashing: index from the high bits, sign from the low bit; sublinear tf, each block
    (words, chars) L2-normalised so that length lives in the statistics, not in the n-gram mass."""
    blocks = []
    for hashes, buckets, offset in ((word_hashes, word_buckets, 0), (char_hashes, char_buckets, word_buckets)):
        if hashes:
            h = np.concatenate(hashes)
            blocks.append(((h >> np.uint64(32)) % np.uint64(buckets)).astype(np.int64) + offset)
            blocks.append(h)
    if not blocks:
        return np.zeros(0, np.int64), np.zeros(0, np.float64)
    # One sort of (index, sign bit) keys; the signed count of an index is (#positive - #negative).
    keys = (np.concatenate(blocks[0::2]) << 1) | (np.concatenate(blocks[1::2]) & np.uint64(1)).astype(np.int64)
    keys.sort()
    idx = keys >> 1
    sign = 1.0 - 2.0 * (keys & 1)
    first = np.empty(idx.size, dtype=bool)
    first[0] = True
    np.not_equal(idx[1:], idx[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    uniq = idx[starts]
    vals = np.add.reduceat(sign, starts)
    vals = np.sign(vals) * np.log1p(np.abs(vals))
    in_words = uniq < word_buckets
    for mask in (in_words, ~in_words):
        norm = np.sqrt(np.dot(vals[mask], vals[mask]))
        if norm > 0:
            vals[mask] /= norm
    keep = vals != 0
    return uniq[keep], vals[keep]


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
    """Turns a conversation into `PromptFeatures` under a fixed `FeatureConfig` (pure numpy, no sklearn)."""

    def __init__(self, config: FeatureConfig | None = None):
        self.config = config or FeatureConfig()
        self._stat_pos = [STAT_NAMES.index(s) for s in self.config.stats]

    def __call__(self, x: Conversation, extras: Mapping[str, float] | None = None) -> PromptFeatures:
        cfg = self.config
        full_turns = normalize_conversation(x)
        turns = _clip_turns(full_turns, cfg.max_chars)
        body = "\n".join(text for _, text in turns)
        codes = np.frombuffer(body.encode("utf-32-le"), dtype=np.uint32)
        words_per_turn = [_WORD_RE.findall(text.lower()) for _, text in turns]

        stats = self._stats(full_turns, body, codes, words_per_turn)[self._stat_pos]
        extra_vals = np.zeros(len(cfg.extras))
        missing = []
        for i, name in enumerate(cfg.extras):
            value = None if extras is None else extras.get(name)
            if value is None:
                missing.append(name)
            else:
                extra_vals[i] = float(value)

        indices, values = _hashed_part(self._word_hashes(turns, words_per_turn), self._char_hashes(turns),
                                       cfg.word_buckets, cfg.char_buckets)
        return PromptFeatures(dense=np.concatenate([stats, extra_vals]), indices=indices, values=values,
                              extras_missing=missing)

    def _word_hashes(self, turns: list[tuple[str, str]], words_per_turn: list[list[str]]) -> list[np.ndarray]:
        # The role marker is a token of its own, so "<system> you are" and "<user> you are" differ as bigrams.
        tokens: list[str] = []
        for (role, _), words in zip(turns, words_per_turn):
            tokens.append(f"<{role}>")
            tokens.extend(words)
        base = np.array([_word_hash(t) for t in tokens], dtype=np.uint64)
        lo, hi = self.config.word_ngrams
        out = []
        for n in range(lo, hi + 1):
            if base.size < n:
                break
            h = np.full(base.size - n + 1, _ORDER_SALT[n], dtype=np.uint64)
            for k in range(n):
                h = _mix64(h ^ base[k:base.size - n + 1 + k])
            out.append(h)
        return out

    def _char_hashes(self, turns: list[tuple[str, str]]) -> list[np.ndarray]:
        text = "".join(f"\x02{role}\x03{t.lower()}" for role, t in turns)
        c = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
        out = self._char_ngrams(c, salt=101)
        if self.config.tail_chars:
            # the same n-grams of the very end, in their own hash space: the continuation depends on them most
            out += self._char_ngrams(c[-self.config.tail_chars:], salt=211)
        return out

    def _char_ngrams(self, c: np.ndarray, salt: int) -> list[np.ndarray]:
        lo, hi = self.config.char_ngrams
        out = []
        for n in range(lo, hi + 1):
            if c.size < n:
                break
            # polynomial hash of each window (vectorised over positions, looped over the n offsets), then mixed
            h = np.full(c.size - n + 1, np.uint64(n + salt), dtype=np.uint64)
            for k in range(n):
                h = h * _CHAR_MULT + c[k:c.size - n + 1 + k]
            out.append(_mix64(h))
        return out

    @staticmethod
    def _stats(full_turns: list[tuple[str, str]], body: str, codes: np.ndarray,
               words_per_turn: list[list[str]]) -> np.ndarray:
        """Lengths and turn counts from the whole conversation; ratios from the clipped tail (`body`)."""
        n = max(codes.size, 1)
        total_chars = sum(len(t) for _, t in full_turns) + max(len(full_turns) - 1, 0)
        total_lines = sum(t.count("\n") for _, t in full_turns) + max(len(full_turns), 1)
        total_words = sum(len(t.split()) for _, t in full_turns)
        counts = np.bincount(_CHAR_CLASS[np.minimum(codes, 128)], minlength=_NUM_CLASSES)
        lines = body.split("\n")
        words = [w for ws in words_per_turn for w in ws]
        starts = np.flatnonzero(codes[:-1] == 10) + 1
        first = np.concatenate([codes[:1], codes[starts]])
        line_starts = np.bincount(_CHAR_CLASS[np.minimum(first, 128)], minlength=_NUM_CLASSES)
        hash_lines = np.count_nonzero((first == 35) | (first == 47))  # '#' or '/' comments
        num_lines = max(first.size, 1)
        roles = [r for r, _ in full_turns]
        last_chars = len(full_turns[-1][1]) if full_turns else 0
        punct = counts[_BRACKET] + counts[_QUOTE] + counts[_QUESTION] + counts[_PUNCT]
        last_line = lines[-1] if lines else ""
        stripped = last_line.lstrip(" \t")
        # an odd number of triple quotes so far: the conversation stops inside a docstring or long string
        triple = (body.count('"""') + body.count("'''")) % 2
        return np.array([
            np.log1p(total_chars),
            np.log1p(total_words),
            np.log1p(total_lines),
            np.log1p(last_chars),
            sum(map(len, words)) / len(words) if words else 0.0,
            np.log1p(len(body) / max(len(lines), 1)),
            np.log1p(max(map(len, lines))),
            counts[_DIGIT] / n,
            punct / n,
            counts[_UPPER] / n,
            counts[_SPACE] / n,
            counts[_NON_ASCII] / n,
            line_starts[_SPACE] / num_lines,
            line_starts[_NEWLINE] / num_lines,
            hash_lines / num_lines,
            sum(1 for w in words if w in _CODE_KEYWORDS) / max(len(words), 1),
            counts[_BRACKET] / n,
            counts[_QUOTE] / n,
            counts[_QUESTION] / num_lines,
            np.log1p(len(full_turns)),
            float(roles.count("user")),
            float(roles.count("assistant")),
            float("system" in roles or "developer" in roles),
            last_chars / max(total_chars, 1),
            float(bool(last_line)),
            np.log1p(len(last_line)),
            np.log1p(len(last_line) - len(stripped)),
            float(stripped.startswith(("#", "//"))),
            float(triple),
        ], dtype=np.float64)
