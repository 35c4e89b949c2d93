"""Constrained decoding: a request's `StructuredOutput` (JSON schema, any JSON object, regex, choice, EBNF
grammar) compiled once per engine by xgrammar (bounded cache keyed by the constraint), and per sequence a
`Grammar` whose token masks the sampler, the verifier and the drafter apply. The grammar's state always
matches the sequence's tokens: `Scheduler.append_token` advances it; masks for a speculative window or a
draft are computed by advancing and rolling back at once."""

from __future__ import annotations

import collections
import json
import re
import threading
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import engines.schema_support as schema_support
import engines.tool_grammar as tool_grammar
from engines.llguidance_backend import LLGTemplate, LLGuidanceBackend, LLGuidanceError, clean_message

if TYPE_CHECKING:
    import xgrammar

KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_calls")


class InvalidConstraint(ValueError):
    """A constraint the grammar library cannot compile; `param` names the request field; for a schema keyword
    no backend enforces exactly, `keyword` and `pointer` (JSON pointer) name it."""

    def __init__(self, param: str, message: str, keyword: str | None = None, pointer: str | None = None):
        super().__init__(message)
        self.param, self.keyword, self.pointer = param, keyword, pointer

    @property
    def where(self) -> str:
        """The request field, with the keyword's JSON pointer after '#' for a schema keyword."""
        return self.param if self.pointer is None else f"{self.param}#{self.pointer}"


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. `kind`: json (spec is a JSON schema, as a canonical JSON string),
    json_object (any JSON object; spec unused), regex, choice (spec: a JSON list of strings), grammar (EBNF),
    tool_calls (tool_choice auto: free text and Hermes calls; spec from engines/tool_grammar.py `spec`).
    `param` names the request field it came from (for errors)."""

    kind: str
    spec: str = ""
    param: str = "response_format"

    @classmethod
    def json_schema(cls, schema: Any, param: str = "response_format") -> StructuredOutput:
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":")), param)

    @classmethod
    def choice(cls, options: Seq[str], param: str = "guided_choice") -> StructuredOutput:
        return cls("choice", json.dumps(list(options)), param)


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else c for c in text)


class GrammarCompiler:
    """One engine's compiler: the tokenizer's vocabulary as xgrammar sees it and an LRU of compiled grammars
    (`max_cached` entries; thread-safe: requests are validated on the callers' threads)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Seq[int], max_cached: int = 128):
        import xgrammar as xgr

        backend = tokenizer.backend
        vocab = backend.get_vocab(with_added_tokens=True)
        encoded = [""] * max(vocab_size, len(vocab))
        for tok, i in vocab.items():
            encoded[i] = tok
        vocab_type, prefix_space = _vocab_meta(backend)
        info = xgr.TokenizerInfo(encoded[:vocab_size], vocab_type, vocab_size=vocab_size,
                                 stop_token_ids=sorted(stop_token_ids), add_prefix_space=prefix_space)
        self._setup(info, vocab_size, max_cached, (backend.to_str(), vocab_size, list(stop_token_ids)))

    def _setup(self, info, vocab_size: int, max_cached: int, llg_args: tuple[str, int, list[int]],
               max_cached_bytes: int = 256 << 20) -> None:
        import xgrammar as xgr

        self.info = info
        self.vocab_size = vocab_size
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: collections.OrderedDict[tuple[str, str], xgrammar.CompiledGrammar] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.max_cached = max_cached
        self.max_cached_bytes = max_cached_bytes  # by xgrammar's memory_size_bytes of each compiled grammar
        self.cached_bytes = 0
        self.num_compiled = 0
        self._llg_args = llg_args  # (tokenizer.json text, vocab size, stop ids): what llguidance is built from
        self._llg: LLGuidanceBackend | None = None  # the second backend, built with the first schema needing it
        self._info = info
        self._control: tuple[frozenset[int], torch.Tensor] | None = None  # built with the first JSON matcher

    @classmethod
    def from_info(cls, info, llg_args: tuple[str, int, list[int]]) -> GrammarCompiler:
        """A compiler over an `xgrammar.TokenizerInfo` and llguidance's arguments (a compile worker's,
        engines/compile_pool.py)."""
        self = cls.__new__(cls)
        self._setup(info, info.vocab_size, 0, tuple(llg_args))
        return self

    def worker_info(self) -> str:
        """What a compile worker builds the same compiler from (`from_info`), as JSON text."""
        return json.dumps({"xgrammar": self.info.serialize_json(), "llguidance": list(self._llg_args)})

    def compile_uncached(self, so: StructuredOutput) -> xgrammar.CompiledGrammar:
        """`so` compiled, leaving the cache alone; InvalidConstraint naming its field."""
        return self._compile(so)

    def compile(self, so: StructuredOutput) -> xgrammar.CompiledGrammar:
        key = (so.kind, so.spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(so)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = compiled
                self.cached_bytes += _memory_bytes(compiled)
            self.num_compiled += 1
            while len(self._cache) > 1 and (len(self._cache) > self.max_cached
                                            or self.cached_bytes > self.max_cached_bytes):
                self.cached_bytes -= _memory_bytes(self._cache.popitem(last=False)[1])
        return compiled

    def _compile(self, so: StructuredOutput) -> xgrammar.CompiledGrammar:
        c = self._compiler
        try:
            if so.kind == "json":
                return self._compile_schema(so)
            if so.kind == "json_object":
                return CompactJSON(c.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                         separators=(", ", ": "), strict_mode=False))
            if so.kind == "regex":
                check_regex(so)
                return c.compile_regex(so.spec)
            if so.kind == "choice":
                options = json.loads(so.spec)
                return c.compile_regex("|".join(f"({_regex_literal(o)})" for o in options))
            if so.kind == "grammar":
                return c.compile_grammar(so.spec)
            if so.kind == "tool_calls":
                return self._compile_tool_calls(so)
        except InvalidConstraint:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with its parser's message
            raise InvalidConstraint(so.param, f"{so.param} cannot be compiled: {clean_message(str(e))}") from None
        raise InvalidConstraint(so.param, f"{so.param}: unknown constraint kind {so.kind!r}")

    def _compile_schema(self, so: StructuredOutput) -> Any:
        """A JSON schema on the backend that enforces all of its keywords (engines/schema_support.py), or
        InvalidConstraint naming the keyword and its JSON pointer."""
        try:
            chosen = schema_support.plan(json.loads(so.spec))
        except schema_support.SchemaRefused as e:
            raise InvalidConstraint(so.param, f"{so.param}: {e}", keyword=e.keyword, pointer=e.pointer) from None
        if chosen.backend == schema_support.XGRAMMAR:
            try:
                return CompactJSON(self._compiler.compile_json_schema(
                    json.dumps(chosen.schema), any_whitespace=False, separators=(", ", ": ")))
            except Exception:  # e.g. a combination xgrammar rejects: llguidance may still take it
                pass
        try:
            return self._llguidance().compile_json(chosen.schema)
        except LLGuidanceError as e:
            keyword, pointer = _blame(str(e), chosen.needs or schema_support.keyword_pointers(chosen.schema))
            where = f"schema's `{keyword}` at {pointer or '/'}" if keyword else "schema"
            raise InvalidConstraint(so.param, f"{so.param}: the JSON {where} cannot be enforced exactly ({e})",
                                    keyword=keyword, pointer=pointer) from None

    def _compile_tool_calls(self, so: StructuredOutput) -> Any:
        """tool_choice auto's grammar: xgrammar's structural tag when xgrammar covers every tool's parameters,
        else the Lark form on llguidance; InvalidConstraint naming the tool's parameters keyword."""
        try:
            if tool_grammar.xgrammar_covers(so.spec):
                try:
                    return tool_grammar.compile_tool_calls(self._compiler, so.spec)
                except tool_grammar.XGrammarRejected:
                    pass  # llguidance may still take it
            lark = tool_grammar.lark_grammar(so.spec)
        except tool_grammar.ToolGrammarRefused as e:
            raise InvalidConstraint(e.param, f"{e.param} under tool_choice auto: {clean_message(str(e))}",
                                    keyword=e.keyword, pointer=e.pointer) from None
        try:
            return self._llguidance().compile_lark(lark)
        except LLGuidanceError as e:
            raise self._blame_tool(so, e) from None

    def _blame_tool(self, so: StructuredOutput, error: LLGuidanceError) -> InvalidConstraint:
        """The refusal of a tool-call grammar llguidance rejected, naming the first schema in it that llguidance
        rejects alone (a tool's parameters or the answer), and its keyword."""
        data = json.loads(so.spec)
        parts = [(tool_grammar.tool_param(i), t["parameters"]) for i, t in enumerate(data["tools"])]
        if "answer" in data:
            parts.append((data["answer_param"], data["answer"]))
        for param, schema in parts:
            chosen = schema_support.plan(schema)
            try:
                self._llguidance().compile_json(chosen.schema)
            except LLGuidanceError as e:
                keyword, pointer = _blame(str(e), chosen.needs or schema_support.keyword_pointers(chosen.schema))
                where = f"`{keyword}` at {pointer or '/'}" if keyword else "schema"
                return InvalidConstraint(param, f"{param} under tool_choice auto: the JSON schema's {where} cannot "
                                         f"be enforced exactly ({e})", keyword=keyword, pointer=pointer)
        return InvalidConstraint(so.param, f"{so.param}: the tools' grammar cannot be enforced exactly ({error})")

    def _llguidance(self) -> LLGuidanceBackend:
        if self._llg is None:
            with self._lock:
                if self._llg is None:
                    self._llg = LLGuidanceBackend(*self._llg_args)
        return self._llg

    def cached(self, so: StructuredOutput) -> bool:
        """Whether `compile(so)` would return at once (the caller can compile elsewhere otherwise)."""
        with self._lock:
            return (so.kind, so.spec) in self._cache

    def matcher(self, compiled: xgrammar.CompiledGrammar | LLGTemplate) -> Grammar:
        """A fresh per-sequence state over a compiled grammar."""
        if isinstance(compiled, LLGTemplate):
            return Grammar(compiled.matcher(), self.vocab_size)
        if isinstance(compiled, CompactJSON):
            if self._control is None:
                self._control = _control_tokens(self._info, self.vocab_size)
            return Grammar(self._xgr.GrammarMatcher(compiled.compiled), self.vocab_size, *self._control)
        return Grammar(self._xgr.GrammarMatcher(compiled), self.vocab_size)


class CompactJSON:
    """A JSON grammar compiled by xgrammar for the compact layout: no raw byte below 0x20 belongs in its output
    (xgrammar lets control characters into length-bounded strings, which is not JSON), so its Grammars mask
    the tokens holding one."""

    __slots__ = ("compiled",)

    def __init__(self, compiled):
        self.compiled = compiled


def _memory_bytes(compiled: object) -> int:
    """What a cached grammar holds, for the cache's byte bound: xgrammar's own count; llguidance's grammars
    (built lazily per matcher, small when cached) count as LLG_CACHED_BYTES."""
    inner = compiled.compiled if isinstance(compiled, CompactJSON) else compiled
    size = getattr(inner, "memory_size_bytes", None)
    return int(size) if size is not None else LLG_CACHED_BYTES


LLG_CACHED_BYTES = 64 << 10


def _control_tokens(info, vocab_size: int) -> tuple[frozenset[int], torch.Tensor]:
    """The tokens whose bytes hold a control character (below 0x20; stop tokens excepted), and the packed
    mask [W] allowing every other token."""
    stops = set(info.stop_token_ids)
    forbidden = frozenset(i for i, b in enumerate(info.decoded_vocab[:vocab_size])
                          if i not in stops and any(c < 0x20 for c in b))
    bits = torch.ones(-(-vocab_size // 32) * 32, dtype=torch.int64)
    bits[list(forbidden)] = 0
    packed = (bits.view(-1, 32) << torch.arange(32, dtype=torch.int64)).sum(1)
    return forbidden, torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


class Grammar:
    """One sequence's grammar state over its output tokens (a matcher and a mask buffer). `forbidden` tokens
    are refused whatever the matcher says (`allowed`: the packed mask of every other token)."""

    __slots__ = ("matcher", "vocab_size", "_buf", "_xgr", "forbidden", "allowed")

    def __init__(self, matcher, vocab_size: int, forbidden: frozenset[int] = frozenset(),
                 allowed: torch.Tensor | None = None):
        import xgrammar as xgr

        self._xgr = xgr
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._buf = xgr.allocate_token_bitmask(1, vocab_size)
        self.forbidden, self.allowed = forbidden, allowed

    def accept(self, token: int) -> None:
        """The sequence appended `token` (the masks allowed it)."""
        if self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token):
            raise ValueError(f"token {token} violates the request's output constraint")

    def next_mask(self) -> torch.Tensor:
        """The packed mask [W] (int32, one bit per token) of what may come next; all allowed once terminated."""
        return self._mask_of(self.matcher)

    def _mask_of(self, m) -> torch.Tensor:
        if m.is_terminated():
            return torch.full((self._buf.shape[1],), -1, dtype=torch.int32)
        m.fill_next_token_bitmask(self._buf, 0)
        return self._buf[0].clone() if self.allowed is None else self._buf[0] & self.allowed

    def _lookahead(self):
        """The matcher to take drafts on and whether it must roll them back: xgrammar's own (its rollback is
        exact), an llguidance fork (its rollback is not after masks were computed: llguidance_backend.py)."""
        fork = getattr(self.matcher, "fork", None)
        return (fork(), False) if fork is not None else (self.matcher, True)

    def window_masks(self, drafts: Seq[int]) -> torch.Tensor:
        """Masks [k + 1, W] for the positions of a speculative window: position j after drafts[:j]. A position
        after a draft the grammar forbids allows everything (verification never gets past that draft)."""
        out = torch.full((len(drafts) + 1, self._buf.shape[1]), -1, dtype=torch.int32)
        m, roll_back = self._lookahead()
        taken = 0
        for j in range(len(drafts) + 1):
            if m.is_terminated():
                break
            m.fill_next_token_bitmask(out, j)
            if j == len(drafts) or drafts[j] in self.forbidden or not m.accept_token(drafts[j]):
                break
            taken += 1
        if taken and roll_back:
            m.rollback(taken)
        if self.allowed is not None:  # rows past a refused draft stay "all" but for the forbidden tokens
            out.bitwise_and_(self.allowed)
        return out

    def draft_mask(self, token_ids_since: Seq[int]) -> torch.Tensor:
        """The mask after the drafts so far (`token_ids_since`), leaving the state as it was."""
        if not token_ids_since:
            return self.next_mask()
        m, roll_back = self._lookahead()
        taken = 0
        for t in token_ids_since:
            if m.is_terminated() or t in self.forbidden or not m.accept_token(t):
                break
            taken += 1
        try:
            return self._mask_of(m)
        finally:
            if taken and roll_back:
                m.rollback(taken)


class MaskPrefetch:
    """Computes a step's grammar masks on a worker thread while the forward pass runs (xgrammar releases the
    GIL while it fills a mask). `start` takes the step's sequences and drafts and returns a future of
    seq_id -> masks [k + 1, W]: row j is the mask after the first j drafts (a plain row has k = 0). Only
    sequences with a grammar are touched; a step without any submits nothing. The engine thread must not
    touch those grammars until the future is done (it waits for it before sampling)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def start(self, seqs: Seq, drafts: Mapping[int, list[int]]) -> Future | None:
        todo = [(s.seq_id, s.grammar, drafts.get(s.seq_id)) for s in seqs if s.grammar is not None]
        if not todo:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._pool.submit(_masks_for, todo)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _masks_for(todo: list[tuple[int, Grammar, list[int] | None]]) -> dict[int, torch.Tensor]:
    return {i: g.window_masks(d) if d else g.next_mask()[None] for i, g, d in todo}


def apply_masks(logits: torch.Tensor, rows: Seq[int], masks: Seq[torch.Tensor]) -> None:
    """Set to -inf, in place, the logits of rows `rows` whose token the packed mask forbids (ids past the
    mask's vocabulary are forbidden)."""
    import xgrammar as xgr

    rows = list(rows)
    width = masks[0].shape[0] * 32
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        bitmask, indices = torch.stack(list(masks)), None
    else:  # xgrammar reads row i of the bitmask for row i of the logits
        bitmask = torch.full((logits.shape[0], masks[0].shape[0]), -1, dtype=torch.int32)
        bitmask[rows] = torch.stack(list(masks))
        indices = rows
    if logits.shape[1] > width:
        logits[rows, width:] = float("-inf")
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=min(width, logits.shape[1]),
                                    indices=indices)


def _vocab_meta(backend) -> tuple[Any, bool]:
    """xgrammar's vocabulary type from the tokenizer's decoder, and whether the tokenizer prepends a space
    that decoding strips (SentencePiece-style Metaspace)."""
    import xgrammar as xgr

    dec = json.dumps(json.loads(backend.to_str()).get("decoder") or {})
    if '"ByteLevel"' in dec:
        return xgr.VocabType.BYTE_LEVEL, False
    if '"ByteFallback"' in dec:
        return xgr.VocabType.BYTE_FALLBACK, '"Strip"' in dec
    return xgr.VocabType.RAW, '"Strip"' in dec


def check_regex(so: StructuredOutput) -> None:
    """InvalidConstraint for a regex feature the backend would not enforce exactly."""
    what = schema_support.regex_refusal(so.spec)
    if what is not None:
        raise InvalidConstraint(so.param, f"{so.param}: the regex uses {what}, which tandem cannot enforce")


def _blame(message: str, needs: list[tuple[str, str]]) -> tuple[str | None, str | None]:
    """The (keyword, pointer) llguidance's refusal is about: the first keyword it names among those the walk
    sent to it (or, when xgrammar failed first, among all the schema's), else the first of those."""
    for keyword, pointer in needs:
        if re.search(rf"\b{re.escape(keyword)}\b", message):
            return keyword, pointer
    return needs[0] if needs else (None, None)
