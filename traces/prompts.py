"""Prompt synthesis with exact token counts for the served model's tokenizer.

Prompts are sequences of single-token words (" word" pieces that the pre-tokenizer keeps apart, so counts
add up across concatenation); shared hash-id blocks render to identical text, giving real shared prefixes.
Every prompt is re-encoded and checked: the count is of the text without special tokens (BOS, chat template).
"""

from __future__ import annotations

import random
from pathlib import Path

from traces.workloads import RequestSpec


class PromptSynthesisError(RuntimeError):
    """The tokenizer cannot be used to build prompts of exact length; the message says why."""


def _tokenizer_file(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise PromptSynthesisError(f"no tokenizer.json at {path}; pass --tokenizer <model dir or tokenizer.json>")
    return path


class PromptSynthesizer:
    """Builds prompt text of an exact token count, with shared prefixes for equal hash ids."""

    def __init__(self, tokenizer: str | Path, seed: int = 0):
        from tokenizers import Tokenizer  # the served tokenizer, without transformers or the engines

        self.path = _tokenizer_file(tokenizer)
        self._tok = Tokenizer.from_file(str(self.path))
        self._seed = seed
        self.words = self._single_token_words()
        if len(self.words) < 8:
            raise PromptSynthesisError(
                f"{self.path}: found only {len(self.words)} single-token words; cannot synthesise prompts")
        self._blocks: dict[tuple[int, int], list[str]] = {}

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def _single_token_words(self) -> list[str]:
        """Vocabulary pieces that are " " + letters, encode to one token alone and stay one token when repeated."""
        special = set(self._tok.get_added_tokens_decoder()) if hasattr(self._tok, "get_added_tokens_decoder") else set()
        words = set()
        for tid in range(self._tok.get_vocab_size(with_added_tokens=False)):
            if tid in special:
                continue
            text = self._tok.decode([tid], skip_special_tokens=True)
            for w in (text, " " + text.strip()):
                if len(w) >= 2 and w[0] == " " and w[1:].isascii() and w[1:].isalpha():
                    words.add(w)
        # Verify in one batch: a word qualifies when three copies in a row encode to exactly three tokens.
        ordered = sorted(words)
        encs = self._tok.encode_batch([w * 3 for w in ordered], add_special_tokens=False)
        return [w for w, e in zip(ordered, encs) if len(e.ids) == 3]

    def _words(self, rng: random.Random, n: int) -> list[str]:
        return rng.choices(self.words, k=n)

    def _block(self, hash_id: int, block_tokens: int) -> list[str]:
        key = (hash_id, block_tokens)
        if key not in self._blocks:
            self._blocks[key] = self._words(random.Random(f"{self._seed}:block:{hash_id}"), block_tokens)
        return self._blocks[key]

    def prompt(self, spec: RequestSpec) -> str:
        """Prompt text of exactly `spec.input_tokens` tokens; its first blocks follow `spec.hash_ids`."""
        n = spec.input_tokens
        words: list[str] = []
        for h in spec.hash_ids:
            if len(words) >= n:
                break
            words += self._block(h, spec.block_tokens)
        words = words[:n]
        rng = random.Random(f"{self._seed}:request:{spec.index}")
        words += self._words(rng, n - len(words))
        text = "".join(words)
        got = self.count(text)
        # Pieces are verified one by one, but some tokenizers merge across a boundary: repair the unique tail.
        for _ in range(64):
            if got == n:
                return text
            if got > n:
                words = words[: max(0, len(words) - (got - n))] if len(words) > got - n else words[:1]
            else:
                words += self._words(rng, n - got)
            text = "".join(words)
            got = self.count(text)
        raise PromptSynthesisError(f"{self.path}: could not hit {n} tokens (got {got}) for request {spec.index}")


class WordPrompts:
    """Fallback without a tokenizer: one common English word per intended token (counts approximate)."""

    WORDS = (" the of and to in is it that for on with as was at by be this are from or have an not"
             " but what all were when we there can your which their said if do will each about how up out"
             " them then she many some so these would other into has more her two like him see time").split()

    def __init__(self, seed: int = 0):
        self._seed = seed

    def prompt(self, spec: RequestSpec) -> str:
        words: list[str] = []
        for h in spec.hash_ids:
            words += random.Random(f"{self._seed}:block:{h}").choices(self.WORDS, k=spec.block_tokens)
        words = words[: spec.input_tokens]
        words += random.Random(f"{self._seed}:request:{spec.index}").choices(
            self.WORDS, k=spec.input_tokens - len(words))
        return " " + " ".join(words)
