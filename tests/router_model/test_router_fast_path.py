"""The single-request fast path (the C n-gram helper in router_model.native, the string-level statistics, the
float32 row gather) computes exactly what the reference computes: scikit-learn's HashingVectorizer and the numpy
hashing on real prompts and awkward text, str.split / the \\w+ regex for the word statistics, and the scores and
statistics that the implementation before it gave (tests/router_model/fixtures/reference_scores.json)."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from router_model import native
from router_model.data import parse_example, read_rows
from router_model.features import (
    _CODE_KEYWORDS,
    DEFAULT_BLOCKS,
    FeatureConfig,
    Featurizer,
    HashBlock,
    _count_words,
    _words,
    flatten,
    hash_block,
    hash_block_numpy,
    normalize_conversation,
)
from router_model.router import Router

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "models" / "router"
REFERENCE = json.loads((Path(__file__).parent / "fixtures" / "reference_scores.json").read_text(encoding="utf-8"))
AWKWARD = ["", "a", "ab", "é", "é😀 naïve", "ΣΑΣ σς İstanbul ß", "数据处理 函数 的", "\n\n\n", "  \t  x  \u00a0\u3000 y\u2028",
           "tab\tand\r\nnew\x0bline\x0c\x1c\x1f\x85\x00nul", "x" * 2000, "😀" * 40, "def f(x):\n    return x  # Ünïcödé\n" * 9]


@pytest.fixture(scope="module")
def held_out() -> list[str]:
    rows = read_rows(SHIPPED / "labels" / "test.jsonl.gz")
    return [parse_example(r, "row").conversation for r in rows[::9]]


@pytest.fixture(scope="module")
def helper():
    fn = native.hash_block_fn()
    if fn is None and shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip(f"no C compiler: the numpy reference serves ({native.build_error})")
    assert fn is not None, f"the C helper should build with the compiler on PATH: {native.build_error}"
    return fn


def _vectorizer_row(block: HashBlock, text: str):
    row = block.vectorizer().transform([text])
    row.eliminate_zeros()  # the vectorizer keeps n-grams whose signs cancelled as explicit zeros
    row.sort_indices()
    return row.indices.astype(np.int64), row.data


def test_c_helper_equals_hashing_vectorizer_and_numpy_on_held_out_prompts(helper, held_out):
    texts = held_out + [t + a for t in held_out[:40] for a in AWKWARD[4:8]] + AWKWARD
    blocks = DEFAULT_BLOCKS + (HashBlock("answer", 200, (1, 4), 1 << 16),)
    assert len(texts) > 800
    for block in blocks:
        cut = [block.cut(t) for t in texts]
        rows = block.vectorizer().transform(cut)
        rows.eliminate_zeros()
        analyzer = block.vectorizer().build_analyzer()
        for i, text in enumerate(cut):
            idx, val = hash_block(analyzer, text, block.buckets, block.ngrams)
            ref_idx, ref_val = hash_block_numpy(analyzer, text, block.buckets, block.ngrams)
            assert np.array_equal(idx, rows[i].indices) and np.array_equal(val, rows[i].data), (block, i)
            assert np.array_equal(idx, ref_idx) and val.tobytes() == ref_val.tobytes(), (block, i)


@pytest.mark.parametrize("block", [HashBlock("tail", 0, (1, 8), 1000), HashBlock("tail", 7, (3, 3), 2),
                                   HashBlock("tail", 50, (6, 8), 3 * 7 * 11 * 13), HashBlock("tail", 0, (2, 2), 1 << 20),
                                   HashBlock("tail", 0, (1, 3), (1 << 20) + 1), HashBlock("tail", 90, (1, 4), 1 << 22)])
def test_c_helper_handles_odd_bucket_counts_long_ngrams_and_multibyte_text(helper, block):
    """Up to MAX_SCRATCH_BUCKETS the helper sums in scratch (left all-zero), beyond it sorts: both exact."""
    rng = random.Random(3)
    alphabet = list("ab \t\n_Zé€😀Σ\u00a0\u3000#")
    texts = AWKWARD + ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300))) for _ in range(60)]
    analyzer = block.vectorizer().build_analyzer()
    for text in texts:
        idx, val = hash_block(analyzer, block.cut(text), block.buckets, block.ngrams)
        ref_idx, ref_val = _vectorizer_row(block, block.cut(text))
        assert np.array_equal(idx, ref_idx) and np.array_equal(val, ref_val), repr(text[:40])
        assert idx.size == 0 or (idx.min() >= 0 and idx.max() < block.buckets and np.all(np.diff(idx) > 0))
    held = getattr(native._local, "scratch", None)
    if block.buckets <= native.MAX_SCRATCH_BUCKETS:
        assert held is not None and held[0].size >= block.buckets
    assert held is None or (not held[0].any() and not held[1].any())


def test_featurizer_without_the_helper_gives_the_same_vectors(helper, held_out, monkeypatch):
    cfg = FeatureConfig(blocks=DEFAULT_BLOCKS + (HashBlock("answer", 0, (1, 4), 1 << 12),
                                                 HashBlock("answer", 30, (2, 3), 1 << 21)))  # the sorting path
    convs = held_out[:150] + AWKWARD + [[{"role": "system", "content": "Be terse."}, {"role": "user", "content": t}]
                                        for t in AWKWARD]
    fast = [Featurizer(cfg)(c, answer=str(c)[:50]) for c in convs]
    monkeypatch.setattr(native, "hash_block_fn", lambda: None)
    for c, f in zip(convs, fast):
        ref = Featurizer(cfg)(c, answer=str(c)[:50])
        assert np.array_equal(f.indices, ref.indices) and f.values.tobytes() == ref.values.tobytes()
        assert f.dense.tobytes() == ref.dense.tobytes()


def test_word_counts_equal_str_split_and_the_word_regex():
    rng = random.Random(5)
    spaces = [chr(c) for c in range(0x110000) if chr(c).isspace()]
    alphabet = spaces + list("aZ9_-.(é😀ΣİßǅⅫ") + ["def ", "Return ", "NONE", "self."]
    texts = AWKWARD + ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200))) for _ in range(400)]
    texts += [t.encode("ascii", "ignore").decode() for t in texts]  # the ASCII path
    for text in texts:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        assert _count_words(codes) == len(text.split()), repr(text)
        words = re.findall(r"\w+", text.lower())
        assert _words(text) == (len(words), sum(map(len, words)), sum(w in _CODE_KEYWORDS for w in words)), repr(text)


def test_statistics_equal_the_reference_implementation():
    f = Featurizer()
    assert len(REFERENCE["conversations"]) >= 40
    assert any(len(flatten(normalize_conversation(c["conversation"]))) > 2048 for c in REFERENCE["conversations"])
    for case in REFERENCE["conversations"]:
        got = f(case["conversation"]).dense
        assert got.tolist() == case["stats"], case["conversation"]


def test_shipped_scores_equal_the_reference_implementation():
    router, scorer = Router.load(SHIPPED), Router.load(SHIPPED / "cascade")
    rows = read_rows(SHIPPED / "labels" / "test.jsonl.gz")
    assert len(REFERENCE["prompts"]) >= 150
    for case in REFERENCE["prompts"]:
        ex = parse_example(rows[case["row"]], "row")
        assert router.score(ex.conversation) == pytest.approx(case["router_score"], rel=1e-12, abs=1e-15)
        got = scorer.score(ex.conversation, case["answer_stats"], ex.answer or "x = 1")
        assert got == pytest.approx(case["cascade_score"], rel=1e-12, abs=1e-15)
    # and the batch path (HashingVectorizer.transform) agrees with the single-request path
    examples = [parse_example(rows[c["row"]], "row") for c in REFERENCE["prompts"]]
    dense, hashed = router.featurizer.transform([e.conversation for e in examples])
    assert np.allclose(router.score_many(dense, hashed), [c["router_score"] for c in REFERENCE["prompts"]],
                       rtol=1e-12, atol=1e-15)
