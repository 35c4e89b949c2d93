"""logit_bias and constrained decoding in the engine on the default models (tandem-tiny-l, drafted by
tandem-tiny-s): bias semantics, every sampled answer matches its constraint, greedy output is the same with
and without speculation, a draft the grammar forbids is rejected, compiled grammars are cached and bounded,
and unconstrained requests carry no grammar."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import jsonschema
import pytest
import torch
from grammar_masks import allowed_ids

from engines import LLM, SamplingParams
from engines.errors import RequestRejected
from engines.sampler import SamplerRow, processed_logits
from engines.structured import GrammarCompiler, StructuredOutput

ROOT = Path(__file__).resolve().parents[2]
SMALL, LARGE = ROOT / "models" / "tandem-tiny-s", ROOT / "models" / "tandem-tiny-l"
PROMPT = "def read_config(path):"

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                                  "role": {"enum": ["admin", "dev", "ops"]}},
                 "required": ["id", "role"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
     "required": ["user", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                      "ok": {"type": "boolean"}},
     "required": ["zip", "ok"], "additionalProperties": False},
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def plain():
    return LLM(LARGE, name="l")


@pytest.fixture(scope="module")
def spec():
    return LLM(LARGE, name="l", draft_model=SMALL)


def first_tokens(llm: LLM, params: SamplingParams) -> list[int]:
    return llm.generate(PROMPT, params)[0].outputs[0].token_ids


def test_logit_bias_minus_100_on_the_greedy_token_changes_the_answer(plain):
    greedy = first_tokens(plain, SamplingParams(temperature=0, max_tokens=4))
    banned = first_tokens(plain, SamplingParams(temperature=0, max_tokens=4, logit_bias={greedy[0]: -100}))
    assert banned[0] != greedy[0]


def test_logit_bias_plus_100_forces_a_token_even_when_sampling(plain):
    forced = first_tokens(plain, SamplingParams(temperature=1.0, seed=3, max_tokens=5, logit_bias={42: 100}))
    assert forced == [42] * 5


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logit_bias_output_is_the_same_with_and_without_speculation(plain, spec, temperature):
    greedy = first_tokens(plain, SamplingParams(temperature=0, max_tokens=12))
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=12,
                            logit_bias={greedy[1]: -100, greedy[3]: 4.0})
    if temperature == 0:
        assert first_tokens(spec, params) == first_tokens(plain, params)
    else:  # sampled: both valid; a banned token never appears
        for llm in (plain, spec):
            assert greedy[1] not in first_tokens(llm, params)


def test_logit_bias_outside_the_range_or_vocabulary_is_refused(plain):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101})
    with pytest.raises(RequestRejected, match="logit_bias"):
        plain.generate(PROMPT, SamplingParams(logit_bias={1 << 20: 1.0}))


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_sampled_json_schema_answers_all_validate(plain, spec, which):
    llm = plain if which == "plain" else spec
    for i, schema in enumerate(SCHEMAS):
        params = SamplingParams(temperature=0.8, seed=i, n=3, max_tokens=80,
                                structured=StructuredOutput.json_schema(schema))
        for c in llm.generate(PROMPT, params)[0].outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), schema)
    if which == "spec":
        assert spec.stats()["engine_spec_num_draft_tokens"] > 0


def test_greedy_constrained_output_is_identical_with_and_without_speculation(plain, spec):
    for schema in SCHEMAS:
        params = SamplingParams(temperature=0, max_tokens=80, structured=StructuredOutput.json_schema(schema))
        want = plain.generate(PROMPT, params)[0].outputs[0]
        got = spec.generate(PROMPT, params)[0].outputs[0]
        assert got.token_ids == want.token_ids
        jsonschema.validate(json.loads(got.text), schema)


def test_a_supplied_draft_the_grammar_forbids_is_rejected_and_output_stays_exact(plain):
    so = StructuredOutput("regex", r"[a-z]{3,8}")
    params = SamplingParams(temperature=0, max_tokens=12, structured=so)
    want = plain.generate(PROMPT, params)[0].outputs[0]
    bad = plain.tokenizer.encode("{}} 123 ((")  # nothing of it is allowed
    got = plain.generate(PROMPT, params, draft_token_ids=want.token_ids[:1] + bad)[0].outputs[0]
    assert got.token_ids == want.token_ids and re.fullmatch(r"[a-z]{3,8}", got.text)


@pytest.mark.parametrize("so, check", [
    (StructuredOutput("regex", r"(yes|no), [0-9]{2}"), lambda t: re.fullmatch(r"(yes|no), [0-9]{2}", t)),
    (StructuredOutput.choice(["red", "green", "blue"]), lambda t: t in ("red", "green", "blue")),
    (StructuredOutput("grammar", 'root ::= "x" [0-9] ("," [0-9])? ("," [0-9])?'),
     lambda t: re.fullmatch(r"x\d(,\d){0,2}", t)),
])
def test_regex_choice_json_object_and_ebnf_constraints_hold_when_sampling(spec, so, check):
    outs = spec.generate(PROMPT, SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=40, structured=so))
    for c in outs[0].outputs:
        assert c.finish_reason == "stop" and check(c.text), c.text


def test_json_object_answers_are_objects(plain):
    # the tiny code model often nests past max_tokens: every answer that ends is an object, and most end
    outs = plain.generate('data = {"a": 1}\n', SamplingParams(temperature=0.8, seed=0, n=8, max_tokens=60,
                                                              structured=StructuredOutput("json_object")))
    stopped = [c for c in outs[0].outputs if c.finish_reason == "stop"]
    assert len(stopped) >= 4, [c.text for c in outs[0].outputs]
    for c in outs[0].outputs:
        assert c.text.startswith("{") and c.finish_reason in ("stop", "length"), c.text
    for c in stopped:
        assert isinstance(json.loads(c.text), dict), c.text


def test_min_tokens_and_ignore_eos_are_refused_with_a_constraint():
    so = StructuredOutput("regex", "[a-z]+")
    for field in ("min_tokens", "ignore_eos"):
        with pytest.raises(ValueError, match=field):
            SamplingParams(structured=so, **{field: 1 if field == "min_tokens" else True})


def test_a_bad_constraint_is_refused_naming_its_field(plain):
    with pytest.raises(RequestRejected, match="guided_regex"):
        plain.generate(PROMPT, SamplingParams(structured=StructuredOutput("regex", "(", "guided_regex")))


def test_compiled_grammars_are_cached_by_constraint_and_bounded(plain):
    comp = GrammarCompiler(plain.tokenizer, plain.engine.config.vocab_size, plain.engine.eos_token_ids,
                           max_cached=2)
    a = comp.compile(StructuredOutput.json_schema(SCHEMAS[0]))
    assert comp.compile(StructuredOutput.json_schema(SCHEMAS[0])) is a and comp.num_compiled == 1
    comp.compile(StructuredOutput.json_schema(SCHEMAS[1]))
    comp.compile(StructuredOutput.json_schema(SCHEMAS[2]))
    assert comp.num_compiled == 3 and len(comp._cache) == 2
    assert comp.compile(StructuredOutput.json_schema(SCHEMAS[0])) is not a  # evicted, compiled again


def test_unconstrained_requests_carry_no_grammar(plain):
    req = plain.engine.inputs.process(PROMPT, SamplingParams(max_tokens=2))
    assert all(s.grammar is None for s in req.seqs)


def test_masks_and_bias_apply_to_their_rows_only_in_a_mixed_batch(plain):
    comp = GrammarCompiler(plain.tokenizer, plain.engine.config.vocab_size, plain.engine.eos_token_ids)
    grammar = comp.matcher(comp.compile(StructuredOutput.choice(["class"])))
    allowed = {t for t in range(plain.engine.config.vocab_size)
               if (int(grammar.next_mask()[t // 32]) >> (t % 32)) & 1}
    assert allowed and len(allowed) < 10
    logits = torch.randn(4, plain.engine.config.vocab_size)
    greedy = SamplingParams(temperature=0)
    rows = [SamplerRow(greedy, (), ()), SamplerRow(SamplingParams(temperature=0, logit_bias={7: 100}), (), ()),
            SamplerRow(greedy, (), (), None, grammar.next_mask()), SamplerRow(greedy, (), ())]
    out, _, _ = processed_logits(logits, rows)
    assert torch.equal(out[[0, 3]], logits[[0, 3]])  # untouched rows
    assert int(out[1].argmax()) == 7 and out[1, 7] == logits[1, 7] + 100
    assert {int(t) for t in torch.isfinite(out[2]).nonzero()} == allowed


def test_prefetched_masks_equal_the_ones_computed_inline_and_the_engine_uses_them(plain, monkeypatch):
    """The step computes grammar masks on a worker thread during the forward pass: they must be the masks the
    sampler and the verifier would compute themselves (plain rows and speculative windows), and the sampler
    must not recompute them."""
    from engines.structured import Grammar, MaskPrefetch

    compiler = GrammarCompiler(plain.tokenizer, plain.engine.config.vocab_size, plain.engine.eos_token_ids)
    compiled = compiler.compile(StructuredOutput.json_schema(SCHEMAS[1]))

    class Seq:
        def __init__(self, seq_id, grammar):
            self.seq_id, self.grammar = seq_id, grammar

    a, b, c = (compiler.matcher(compiled) for _ in range(3))
    for t in plain.tokenizer.encode('{"user": {"id": 12'):
        b.matcher.accept_token(t)  # any prefix the grammar allows works; this one is mid-object
    drafts = {2: plain.tokenizer.encode(', "role": "dev"}')}
    prefetch = MaskPrefetch()
    got = prefetch.start([Seq(1, a), Seq(2, b), Seq(3, None), Seq(4, c)], drafts).result()
    prefetch.close()
    assert sorted(got) == [1, 2, 4]
    assert torch.equal(got[1][0], a.next_mask()) and torch.equal(got[4][0], c.next_mask())
    assert torch.equal(got[2], b.window_masks(drafts[2]))
    assert got[2].shape[0] == len(drafts[2]) + 1 and not torch.equal(got[2][0], got[2][-1])

    def watch(name):  # which threads compute this kind of mask
        seen, real = [], getattr(Grammar, name)
        monkeypatch.setattr(Grammar, name, lambda self, *a: seen.append(threading.current_thread().name)
                            or real(self, *a))
        return seen

    params = SamplingParams(temperature=0, max_tokens=40, structured=StructuredOutput.json_schema(SCHEMAS[0]))
    plain_masks = watch("next_mask")
    out = plain.generate(PROMPT, params)[0].outputs[0]  # plain decoding: every mask comes from the prefetch
    jsonschema.validate(json.loads(out.text), SCHEMAS[0])
    assert len(plain_masks) >= len(out.token_ids) and set(plain_masks) == {"grammar-masks_0"}
    monkeypatch.undo()
    windows = watch("window_masks")  # verifying drafts: every window's masks come from the prefetch
    # supplied drafts are verified whatever adaptive k decides (the drafter's own masks are computed as it drafts)
    got = plain.generate(PROMPT, params, draft_token_ids=out.token_ids[:8])[0].outputs[0]
    assert got.token_ids == out.token_ids
    assert windows and set(windows) == {"grammar-masks_0"}


def test_the_async_engine_compiles_a_new_schema_off_the_event_loop(plain, monkeypatch):
    import asyncio

    from engines.async_engine import AsyncEngine

    threads = []
    real = GrammarCompiler.compile
    monkeypatch.setattr(GrammarCompiler, "compile", lambda self, so: threads.append(threading.current_thread())
                        or real(self, so))
    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 3}}, "required": ["k"]}
    params = SamplingParams(temperature=0, max_tokens=20, structured=StructuredOutput.json_schema(schema))

    class Core:  # steps the engine on its own thread, as EngineCore does
        def __init__(self):
            self.wakeup, self.done = threading.Event(), False
            self.thread = threading.Thread(target=self.loop, daemon=True)
            self.thread.start()

        def loop(self):
            while not self.done:
                self.wakeup.wait(0.05)
                self.wakeup.clear()
                while plain.engine.has_work():
                    plain.engine.step()

        def check_alive(self):
            pass

        def wake(self):
            self.wakeup.set()

    async def run():
        core = Core()
        try:
            outs = [o async for o in AsyncEngine(core, plain.engine).generate(PROMPT, params)]
        finally:
            core.done = True
            core.thread.join()
        return outs[-1], threading.current_thread()

    last, loop_thread = asyncio.run(run())
    assert json.loads(last.outputs[0].text).keys() == {"k"}
    assert threads and threads[0] is not loop_thread  # the first (uncached) compile ran on a worker thread


WALK_SCHEMA = {"type": "object", "required": ["tags"], "properties": {  # date-time: llguidance's
    "when": {"type": "string", "format": "date-time"},
    "tags": {"type": "array", "items": {"type": "object", "additionalProperties": {"type": "array"}}}}}


@pytest.mark.parametrize("kind", ["llguidance tool calls or a JSON answer", "llguidance JSON schema",
                                  "xgrammar json_object", "xgrammar tool calls"])
def test_speculative_windows_on_a_grammar_keep_masks_and_state_agreeing(plain, kind):
    """A random walk the way speculation drives a grammar: drafts taken under `draft_mask`, a window's masks
    from `window_masks`, some of the drafts accepted plus a token from the mask after them, over and over.
    Every mask must equal a fresh matcher's at the same tokens, and every token a mask allows must be accepted.
    llguidance's own rollback broke this after ~30 windows (a mask allowed `"]` inside a key, the state then
    refused it: a 500 in schemathesis on route `best`); its lookahead now runs on a fork."""
    import random

    from engines import tool_grammar

    vocab = plain.engine.config.vocab_size
    comp = GrammarCompiler(plain.tokenizer, vocab, plain.engine.eos_token_ids)
    if kind == "llguidance tool calls or a JSON answer":  # response_format json_object, tool_choice auto
        so = StructuredOutput("tool_calls", tool_grammar.spec([("0", True)], True, {"type": "object"}),
                              "tool_choice")
    elif kind == "llguidance JSON schema":
        so = StructuredOutput.json_schema(WALK_SCHEMA)
    elif kind == "xgrammar tool calls":  # tool_choice auto: xgrammar's structural tag
        so = StructuredOutput("tool_calls", tool_grammar.spec(
            [("f", {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "object"}}}})]),
            "tool_choice")
    else:
        so = StructuredOutput("json_object", "")
    compiled = comp.compile(so)
    assert kind.startswith("llguidance") == (type(compiled).__name__ == "LLGTemplate"), type(compiled)
    decode = plain.tokenizer.backend.decode
    # JSON punctuation and no closing brace, so the answers nest and run long
    nesting = {i for i in range(vocab) if any(c in decode([i]) for c in '[":,{') and "}" not in decode([i])}
    ends = set(plain.engine.eos_token_ids)

    def choose(rng: random.Random, ids: list[int], p: float) -> int:
        pick = [i for i in ids if i in nesting] if rng.random() < p else [i for i in ids if i not in ends]
        return rng.choice(pick or ids)

    def fresh(tokens: list[int]) -> torch.Tensor | None:
        """The mask after `tokens` from a matcher that only ever went forward (None once it has ended)."""
        g = comp.matcher(compiled)
        for t in tokens:
            g.accept(t)
        return None if g.matcher.is_terminated() else g.next_mask()

    lengths = []
    for seed in (1100028, 1200081, 7, 8):  # the first two broke llguidance's rollback at windows 32 and 20
        rng = random.Random(seed)
        g = comp.matcher(compiled)
        out: list[int] = []
        for _ in range(40):
            drafts: list[int] = []
            for _ in range(rng.randint(0, 4)):
                drafts.append(choose(rng, allowed_ids(g.draft_mask(drafts), vocab), 0.7))
            masks = g.window_masks(drafts)
            for j in range(len(drafts) + 1):
                want = fresh(out + drafts[:j])
                assert want is None or torch.equal(masks[j], want), (seed, len(out), j)
            acc = rng.randint(0, len(drafts))
            for t in drafts[:acc] + [choose(rng, allowed_ids(masks[acc], vocab), 0.8)]:
                g.accept(t)  # raises where the state refuses what its mask allowed
                out.append(t)
                if g.matcher.is_terminated():
                    break
            if g.matcher.is_terminated():
                break
        lengths.append(len(out))
    assert max(lengths) > 20, lengths  # long enough to have crossed nested brackets
