"""Router features: HashingVectorizer blocks of the prompt's tail (and the small answer), the single-request
path equal to scikit-learn's bit for bit, deterministic across processes, statistics right, bounded."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from router_model.features import (
    STAT_NAMES,
    FeatureConfig,
    Featurizer,
    HashBlock,
    flatten,
    normalize_conversation,
)

CODE = "def f(x):\n    return x + 1\n\n# done 42\n"


def _stat(feats, name: str) -> float:
    return float(feats.dense[STAT_NAMES.index(name)])


def test_single_request_path_equals_hashing_vectorizer_bit_for_bit():
    blocks = (HashBlock("tail", 60, (1, 5), 1 << 12), HashBlock("tail", 300, (2, 5), 1 << 13),
              HashBlock("answer", 0, (1, 3), 1 << 10))
    f = Featurizer(FeatureConfig(blocks=blocks))
    rng = random.Random(0)
    src = open(__file__, encoding="utf-8").read()
    texts = [src[i:i + rng.randint(0, 700)] for i in (rng.randrange(len(src)) for _ in range(60))]
    texts += ["", "é😀 naïve", "\n\n\n"]
    answers = [t[:20] for t in reversed(texts)]
    dense, hashed = f.transform(texts, answers=answers)
    hashed.eliminate_zeros()  # the vectorizer keeps n-grams whose signs cancelled as explicit zeros
    for i, (t, a) in enumerate(zip(texts, answers)):
        one = f(t, answer=a)
        row = hashed[i]
        assert np.array_equal(row.indices, one.indices) and np.array_equal(row.data, one.values), i
        assert np.array_equal(dense[i], one.dense)


def test_blocks_read_the_tail_and_the_answer_in_their_own_ranges():
    cfg = FeatureConfig(blocks=(HashBlock("tail", 10, (2, 3), 256), HashBlock("answer", 0, (1, 2), 128)))
    f = Featurizer(cfg)
    long = "x" * 500 + "return value"
    a = f(long)
    assert a.indices.max() < 256  # no answer: the answer block is empty
    assert np.array_equal(f(long).indices, f("y" * 50 + long[-10:]).indices)  # only the last 10 chars count
    b = f(long, answer="foo(bar)")
    assert (b.indices >= 256).any() and b.indices.max() < cfg.num_hashed
    assert np.linalg.norm(b.values[b.indices >= 256]) == pytest.approx(1.0)


def test_features_do_not_depend_on_python_hash_seed():
    code = ("import json, sys; from router_model.features import Featurizer; f = Featurizer()(sys.argv[1]);"
            "print(json.dumps([f.indices.tolist(), f.values.round(12).tolist()]))")
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run([sys.executable, "-c", code, CODE], capture_output=True, text=True, env=env, check=True)
        outs.append(json.loads(res.stdout))
    assert outs[0] == outs[1]
    assert outs[0][0] == Featurizer()(CODE).indices.tolist()


def test_statistics_of_a_code_snippet():
    f = Featurizer()(CODE)
    assert _stat(f, "log_chars") == pytest.approx(np.log1p(len(CODE)))
    assert _stat(f, "log_lines") == pytest.approx(np.log1p(CODE.count("\n") + 1))
    assert _stat(f, "digit_ratio") == pytest.approx(3 / len(CODE))  # '1', '4', '2'
    assert _stat(f, "bracket_ratio") == pytest.approx(2 / len(CODE))
    assert _stat(f, "indented_line_ratio") == pytest.approx(1 / 4)
    assert _stat(f, "comment_line_ratio") == pytest.approx(1 / 4)
    assert _stat(f, "keyword_ratio") > 0.2  # def, return
    assert _stat(f, "user_turns") == 1 and _stat(f, "has_system") == 0


def test_string_prompt_equals_single_user_message_and_roles_are_marked():
    f = Featurizer()
    a, b = f("How do I sort a list?"), f([{"role": "user", "content": "How do I sort a list?"}])
    assert np.array_equal(a.indices, b.indices) and np.array_equal(a.dense, b.dense)
    as_system = f([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Sort a list."}])
    as_user = f([{"role": "user", "content": "You are terse."}, {"role": "user", "content": "Sort a list."}])
    assert not np.array_equal(as_user.indices, as_system.indices)
    assert _stat(as_system, "has_system") == 1.0


def test_whole_conversation_counts_turns_and_parts_content():
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "first question"}]},
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": "second question?"}]
    assert normalize_conversation(msgs)[1] == ("user", "first question")
    assert flatten(normalize_conversation(msgs)).endswith("\x02user\x03second question?")
    f = Featurizer()(msgs)
    assert _stat(f, "user_turns") == 2 and _stat(f, "assistant_turns") == 1
    assert _stat(f, "log_turns") == pytest.approx(np.log1p(4))


def test_long_prompt_is_bounded_but_length_is_exact():
    long = "".join(f"token{i} " for i in range(20000))
    f = Featurizer()(long)
    assert _stat(f, "log_chars") == pytest.approx(np.log1p(len(long)))
    assert f.indices.size < 1500  # bounded by the 60- and 300-char tails, not the 150k-char prompt


def test_feature_config_round_trips_and_rejects_unknown_names():
    cfg = FeatureConfig(blocks=(HashBlock("answer", 0, (1, 2), 64),), extras=("answer_entropy",))
    assert FeatureConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.needs_answer and not FeatureConfig().needs_answer
    with pytest.raises(ValueError, match="unknown extra"):
        FeatureConfig(extras=("judge_vibes",))
    with pytest.raises(ValueError, match="unknown field"):
        FeatureConfig.from_dict({**cfg.to_dict(), "surprise": 1})
    with pytest.raises(ValueError, match="unknown view"):
        HashBlock("middle")


def test_extras_are_reported_missing_and_filled_when_given():
    f = Featurizer(FeatureConfig(extras=("small_prompt_logprob",)))
    assert f("hi").extras_missing == ["small_prompt_logprob"]
    filled = f("hi", {"small_prompt_logprob": -2.5})
    assert filled.extras_missing == [] and filled.dense[-1] == -2.5


def test_where_the_prompt_stops_is_described():
    inside_doc = Featurizer()('def f():\n    """Return the\n    answer to ever')
    assert _stat(inside_doc, "inside_triple_quote") == 1.0 and _stat(inside_doc, "ends_mid_line") == 1.0
    assert _stat(inside_doc, "last_line_indent") == pytest.approx(np.log1p(4))
    at_line_end = Featurizer()('x = """done"""\n    # note\n')
    assert _stat(at_line_end, "inside_triple_quote") == 0.0 and _stat(at_line_end, "ends_mid_line") == 0.0
