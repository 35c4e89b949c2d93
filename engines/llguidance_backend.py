"""The second grammar backend, llguidance, for JSON schemas whose keywords xgrammar would approximate
(engines/schema_support.py decides) and for tool-call grammars whose parameters need it (a Lark grammar, from
engines/tool_grammar.py): one engine's llguidance tokenizer, grammars compiled into a template matcher, and per sequence a copy with the interface `engines.structured.Grammar` drives."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence as Seq
from typing import Any

# the same compact layout as xgrammar's (separators ", " and ": ", no other whitespace): see docs/structured.md
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                "coerce_one_of": False, "lenient": False}


class LLGuidanceError(ValueError):
    """llguidance refused the grammar; the message is in tandem's words plus llguidance's own reason."""


class LLGuidanceBackend:
    """Built lazily by GrammarCompiler for the first schema that needs it (the tokenizer takes a moment)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_token_ids: Seq[int]):
        import llguidance

        self._llg = llguidance
        self.stop_ids = frozenset(int(t) for t in stop_token_ids)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=sorted(self.stop_ids))

    def compile_json(self, schema: Any) -> LLGTemplate:
        grammar = self._llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
        return self._template(grammar)

    def compile_lark(self, lark: str) -> LLGTemplate:
        """A Lark grammar (engines/tool_grammar.py: its `%json` rules carry JSON_OPTIONS as `x-guidance`)."""
        return self._template(self._llg.LLMatcher.grammar_from_lark(lark))

    def _template(self, grammar: str) -> LLGTemplate:
        is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error or messages:  # a warning means something would not be enforced: refuse that too
            raise LLGuidanceError(clean_message(messages[0] if messages else "rejected"))
        template = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise LLGuidanceError(clean_message(template.get_error()))
        return LLGTemplate(template, self.stop_ids)


class LLGTemplate:
    """A compiled schema: a matcher at the start state, copied for each sequence."""

    __slots__ = ("template", "stop_ids")

    def __init__(self, template, stop_ids: frozenset[int]):
        self.template, self.stop_ids = template, stop_ids

    def matcher(self) -> LLGMatcher:
        return LLGMatcher(self.template.deep_copy(), self.stop_ids)


class LLGMatcher:
    """An llguidance matcher with xgrammar's GrammarMatcher methods that Grammar uses: a refused token leaves
    the state unchanged, and it terminates when a stop token is accepted (llguidance itself stops as soon as
    the grammar cannot continue; that stop token is then kept here, not in llguidance). No `rollback`: looking
    ahead past drafts happens on a `fork`. llguidance 1.9.1's own rollback, after masks were computed past the
    rolled-back tokens, can leave a state whose next masks allow tokens that state then refuses (found by a
    random walk of speculative windows; tests/engines/test_structured.py pins it)."""

    __slots__ = ("m", "stop_ids", "_done")

    def __init__(self, m, stop_ids: frozenset[int], done: bool = False):
        self.m, self.stop_ids = m, stop_ids
        self._done = done

    def is_terminated(self) -> bool:
        return self._done

    def fork(self) -> LLGMatcher:
        """An independent copy at this state (llguidance's deep copy, ~2 us), to look ahead on."""
        return LLGMatcher(self.m.deep_copy(), self.stop_ids, self._done)

    def accept_token(self, token: int) -> bool:
        if self._done:
            return False
        if self.m.is_stopped():
            if token not in self.stop_ids:
                return False
        elif self.m.try_consume_tokens([token]) != 1:
            return False
        self._done = token in self.stop_ids
        return True

    def fill_next_token_bitmask(self, bitmask, index: int = 0) -> None:
        row = bitmask[index]
        if self._done or self.m.is_stopped():  # only a stop token may follow a complete answer
            row.zero_()
            for t in self.stop_ids:
                if t < row.numel() * 32:
                    row[t // 32] |= _bit(t % 32)
            return
        self.m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if self.m.is_error():
            raise ValueError(f"the output constraint failed: {clean_message(self.m.get_error())}")


def _bit(i: int) -> int:
    return (1 << i) - (1 << 32 if i == 31 else 0)  # an int32: bit 31 is the sign


def clean_message(text: str) -> str:
    """A backend message without source locations, timestamps or line noise."""
    text = re.sub(r"\[\d\d:\d\d:\d\d\]\s*", "", text)
    text = re.sub(r"(?:/[\w.+-]+)+\.(?:cc|h|cpp|rs):\d+(?::\d+)?:?\s*", "", text)
    return " ".join(text.split())[:300]
