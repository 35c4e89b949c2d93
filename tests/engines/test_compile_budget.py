"""Every constraint's cost is bounded and no grammar ends in an engine error: size budgets refuse naming the
field and the limit; a compile over its time budget or whose caller left is stopped with its worker process;
a grammar without a finite derivation is refused at compile; sampling options that would leave no allowed
token (a 5e-324 repetition penalty, every allowed token banned) yield the constraint's tokens, with and
without speculation."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path

import pytest
import torch

from engines import LLM, SamplingParams, tool_grammar
from engines.compile_pool import CompileLimits, CompilePool, check_budget
from engines.errors import RequestRejected
from engines.sampler import SamplerRow, processed_logits
from engines.structured import GrammarCompiler, InvalidConstraint, StructuredOutput

ROOT = Path(__file__).resolve().parents[2]
SMALL, LARGE = ROOT / "models" / "tandem-tiny-s", ROOT / "models" / "tandem-tiny-l"
PROMPT = "def read_config(path):"
PERMISSIVE = StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "string"},
                                                                             "b": {"type": "integer"}}})

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def wide_schema(n: int) -> StructuredOutput:
    """n optional string properties: xgrammar's compile of it grows so fast that 10,000 take minutes."""
    return StructuredOutput.json_schema({"type": "object", "properties": {f"key_{i}": {"type": "string"}
                                                                          for i in range(n)}})


@pytest.fixture(scope="module")
def plain():
    return LLM(LARGE, name="l")


@pytest.fixture(scope="module")
def spec():
    return LLM(LARGE, name="l", draft_model=SMALL)


@pytest.mark.parametrize("so, limit", [
    (wide_schema(1001), "max_schema_properties"),
    (StructuredOutput.json_schema({"enum": list(range(1001))}), "max_enum_values"),
    (StructuredOutput.json_schema({"type": "array", "items": {"type": "array", "items": {"type": "array"}}}),
     "max_schema_depth"),
    (StructuredOutput.json_schema({"type": "string", "description": "x" * 70000}), "max_schema_bytes"),
    (StructuredOutput.choice([str(i) for i in range(1001)]), "max_choice_options"),
    (StructuredOutput("grammar", "\n".join(f"r{i} ::= \"a\"" for i in range(1001)) + "\nroot ::= r0",
                      "guided_grammar"), "max_grammar_rules"),
    (StructuredOutput("regex", "a" * 70000, "guided_regex"), "max_grammar_bytes"),
    (StructuredOutput("tool_calls", tool_grammar.spec([("f", json.loads(wide_schema(600).spec)),
                                                       ("g", json.loads(wide_schema(401).spec))]), "tool_choice"),
     "max_schema_properties"),  # summed over the tools
    (StructuredOutput("tool_calls", tool_grammar.spec([("f", {"type": "object"})], True,
                                                      {"enum": list(range(1001))}), "tool_choice"),
     "max_enum_values"),  # the answer beside the tools counts too
])
def test_a_constraint_over_a_size_budget_is_refused_naming_the_field_and_the_limit(so, limit):
    limits = CompileLimits(max_schema_depth=2 if limit == "max_schema_depth" else 32)
    with pytest.raises(InvalidConstraint, match=limit) as info:
        check_budget(so, limits)
    assert info.value.param == so.param
    check_budget(so, CompileLimits(max_schema_properties=2000, max_enum_values=2000, max_schema_depth=64,
                                   max_schema_bytes=1 << 20, max_choice_options=2000, max_grammar_rules=2000,
                                   max_grammar_bytes=1 << 20))  # within larger budgets: no refusal


def test_the_engine_refuses_an_over_budget_schema_as_a_request_error_naming_its_field(plain):
    with pytest.raises(RequestRejected, match="max_schema_bytes") as info:
        plain.generate(PROMPT, SamplingParams(max_tokens=4, structured=wide_schema(10_000)))
    assert info.value.param == "response_format"


@pytest.mark.parametrize("grammar", ["root ::= root", 'root ::= "a" x | "b"\nx ::= "c" x', "root ::= x{1,3}\nx ::= x"])
def test_a_grammar_without_a_finite_derivation_is_refused_at_compile(plain, grammar):
    so = StructuredOutput("grammar", grammar, "guided_grammar")
    with pytest.raises(RequestRejected, match="derives no finite string") as info:
        plain.generate(PROMPT, SamplingParams(max_tokens=4, structured=so))
    assert info.value.param == "guided_grammar"


def test_a_recursive_grammar_with_an_exit_still_compiles_and_holds(plain):
    so = StructuredOutput("grammar", 'root ::= "(" root ")" | "x"', "guided_grammar")
    text = plain.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, structured=so))[0].outputs[0].text
    depth = len(text) - len(text.lstrip("("))
    assert text == "(" * depth + "x" + ")" * depth or (text.startswith("(" * depth) and "x" not in text)


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, None), (1.0, 7), (0.05, 3)])
def test_a_tiny_repetition_penalty_beside_a_permissive_schema_still_gives_schema_tokens(plain, spec, temperature,
                                                                                        seed):
    # 5e-324 rounds to 0 in float32: every seen positive logit becomes +inf, the softmax NaN; the mask wins
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=40, repetition_penalty=5e-324,
                            frequency_penalty=2.0, presence_penalty=2.0, structured=PERMISSIVE)
    for llm in (plain, spec):
        out = llm.generate(PROMPT, params)[0]
        c = out.outputs[0]
        assert out.error is None if hasattr(out, "error") else True
        assert c.finish_reason in ("stop", "length"), c
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict), c.text
        else:
            assert c.text.startswith("{"), c.text
    if seed is not None or temperature == 0:  # reproducible rows: the same tokens with and without drafts
        assert (plain.generate(PROMPT, params)[0].outputs[0].token_ids
                == spec.generate(PROMPT, params)[0].outputs[0].token_ids)


def test_when_sampling_options_leave_no_allowed_token_the_constraint_wins(plain):
    comp = GrammarCompiler(plain.tokenizer, plain.engine.config.vocab_size, plain.engine.eos_token_ids)
    g = comp.matcher(comp.compile(StructuredOutput("choice", json.dumps(["yes"]))))
    mask = g.next_mask()
    vocab = plain.engine.config.vocab_size
    logits = torch.randn(3, vocab)
    allowed = [t for t in range(vocab) if (int(mask[t // 32]) >> (t % 32)) & 1]
    logits[1, allowed] = float("nan")  # a broken row: nothing finite
    logits[2, allowed] = float("inf")
    rows = [SamplerRow(SamplingParams(temperature=1.0, logit_bias={t: -100.0 for t in allowed[:3]}), (), (), None,
                       mask) for _ in range(3)]
    rows[0].params = SamplingParams(temperature=1.0, repetition_penalty=5e-324)
    rows[0].prompt_token_ids = allowed
    penalised, random_rows, x = processed_logits(logits, rows, [set()] * 3)
    assert random_rows == [0, 1, 2]
    for r in range(3):
        probs = x[r].softmax(-1)
        assert torch.isfinite(probs).all(), r
        assert set(probs.nonzero()[:, 0].tolist()) <= set(allowed), r  # only what the grammar allows
        assert int(penalised[r].argmax()) in allowed


def _info(plain) -> tuple[str, str]:
    comp = GrammarCompiler(plain.tokenizer, plain.engine.config.vocab_size, plain.engine.eos_token_ids)
    text = comp.worker_info()
    return hashlib.sha256(text.encode()).hexdigest(), text


def test_a_compile_over_its_time_budget_or_whose_caller_left_is_stopped_with_its_process(plain):
    limits = CompileLimits(compile_timeout_s=1.5, compile_workers=1, max_schema_properties=20_000,
                           max_schema_bytes=1 << 20)
    pool = CompilePool(limits)
    try:
        info = _info(plain)
        small, _ = pool.prove(info, StructuredOutput.json_schema({"type": "string"}))
        assert small.result(timeout=300) >= 0  # also waits for the small lane's worker to start
        with pytest.raises(InvalidConstraint, match="compile_timeout_s") as err:
            pool.prove(info, wide_schema(10_000))[0].result(timeout=300)
        assert err.value.param == "response_format"
        # the next proof on the same lane gets a fresh worker: the killed one held the compile
        assert pool.large.slots[0].job is None
        future, abandon = pool.prove(info, wide_schema(10_000))
        while pool.large.slots[0].job is None:  # wait for the worker to take it
            time.sleep(0.05)
        proc = pool.large.slots[0].proc
        abandon.set()
        with pytest.raises(InvalidConstraint, match="client left"):
            future.result(timeout=60)
        assert proc.poll() is not None  # the process compiling it is gone
        bad, _ = pool.prove(info, StructuredOutput("grammar", "root ::= root", "guided_grammar"))
        with pytest.raises(InvalidConstraint, match="derives no finite string"):
            bad.result(timeout=300)
        assert pool.stalled() is None
    finally:
        pool.close()


def test_the_async_engine_cancels_a_compile_when_its_caller_is_cancelled(plain):
    pool = CompilePool(CompileLimits(compile_timeout_s=60, compile_workers=1, max_schema_properties=20_000,
                                     max_schema_bytes=1 << 20))
    inputs = plain.engine.inputs
    own = inputs.compile_pool
    inputs.compile_pool = pool
    try:
        async def main():
            task = asyncio.ensure_future(inputs.precompile_async(wide_schema(10_000)))
            while not pool.large.slots or pool.large.slots[0].job is None:
                await asyncio.sleep(0.05)
            proc = pool.large.slots[0].proc
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(200):
                if proc.poll() is not None:
                    return True
                await asyncio.sleep(0.05)
            return False
        assert asyncio.run(main())
    finally:
        inputs.compile_pool = own
        pool.close()
