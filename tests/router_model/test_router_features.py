"""Router features: deterministic across processes, roles marked, statistics right, bounded on long prompts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from router_model.features import STAT_NAMES, FeatureConfig, Featurizer, normalize_conversation

CODE = "def f(x):\n    return x + 1\n\n# done 42\n"


def _stat(feats, name: str) -> float:
    return float(feats.dense[STAT_NAMES.index(name)])


def test_same_prompt_gives_identical_features_twice():
    f = Featurizer()
    a, b = f(CODE), f(CODE)
    assert np.array_equal(a.indices, b.indices) and np.array_equal(a.values, b.values)
    assert np.array_equal(a.dense, b.dense)


def test_features_do_not_depend_on_python_hash_seed():
    code = ("import json, sys; from router_model.features import Featurizer; f = Featurizer()(sys.argv[1]);"
            "print(json.dumps([f.indices.tolist(), f.values.round(12).tolist()]))")
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run([sys.executable, "-c", code, CODE], capture_output=True, text=True, env=env, check=True)
        outs.append(json.loads(res.stdout))
    assert outs[0] == outs[1]
    local = Featurizer()(CODE)
    assert outs[0][0] == local.indices.tolist()


def test_hashed_part_is_sorted_in_range_and_each_block_unit_norm():
    cfg = FeatureConfig(word_buckets=1 << 10, char_buckets=1 << 11)
    f = Featurizer(cfg)(CODE * 3)
    assert np.all(np.diff(f.indices) > 0)
    assert f.indices.min() >= 0 and f.indices.max() < cfg.num_hashed
    words = f.indices < cfg.word_buckets
    assert words.any() and (~words).any()
    assert np.linalg.norm(f.values[words]) == pytest.approx(1.0)
    assert np.linalg.norm(f.values[~words]) == pytest.approx(1.0)


def test_statistics_of_a_code_snippet():
    f = Featurizer()(CODE)
    assert _stat(f, "log_chars") == pytest.approx(np.log1p(len(CODE)))
    assert _stat(f, "log_lines") == pytest.approx(np.log1p(CODE.count("\n") + 1))
    assert _stat(f, "digit_ratio") == pytest.approx(3 / len(CODE))  # '1', '4', '2'
    assert _stat(f, "bracket_ratio") == pytest.approx(2 / len(CODE))
    # lines: "def..", "    return..", "", "# done 42", "" -> 1 indented, 1 comment, blank = empty line starts
    assert _stat(f, "indented_line_ratio") == pytest.approx(1 / 4)
    assert _stat(f, "comment_line_ratio") == pytest.approx(1 / 4)
    assert _stat(f, "keyword_ratio") > 0.2  # def, return
    assert _stat(f, "user_turns") == 1 and _stat(f, "has_system") == 0


def test_string_prompt_equals_single_user_message():
    f = Featurizer()
    a, b = f("How do I sort a list?"), f([{"role": "user", "content": "How do I sort a list?"}])
    assert np.array_equal(a.indices, b.indices) and np.array_equal(a.dense, b.dense)


def test_roles_are_marked_in_the_hashed_features():
    f = Featurizer()
    as_user = f([{"role": "user", "content": "You are terse. Sort a list."}])
    as_system = f([{"role": "system", "content": "You are terse. Sort a list."}])
    assert not np.array_equal(as_user.indices, as_system.indices)
    assert _stat(as_system, "has_system") == 1.0


def test_whole_conversation_counts_turns_and_parts_content():
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "first question"}]},
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": "second question?"}]
    assert normalize_conversation(msgs)[1] == ("user", "first question")
    f = Featurizer()(msgs)
    assert _stat(f, "user_turns") == 2 and _stat(f, "assistant_turns") == 1
    assert _stat(f, "log_turns") == pytest.approx(np.log1p(4))
    total = len("\n".join(t for _, t in normalize_conversation(msgs)))
    assert _stat(f, "last_message_share") == pytest.approx(len("second question?") / total)


def test_long_prompt_is_clipped_for_hashing_but_length_is_exact():
    cfg = FeatureConfig(max_chars=1000)
    long = "word%d " * 1 + "".join(f"token{i} " for i in range(20000))
    f = Featurizer(cfg)(long)
    assert _stat(f, "log_chars") == pytest.approx(np.log1p(len(long)))
    assert f.indices.size < 4000  # bounded by the clipped tail, not the 150k-char prompt


def test_feature_config_round_trips_and_rejects_unknown_names():
    cfg = FeatureConfig(word_buckets=256, extras=("small_prompt_logprob",))
    assert FeatureConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="unknown extra"):
        FeatureConfig(extras=("judge_vibes",))
    with pytest.raises(ValueError, match="unknown field"):
        FeatureConfig.from_dict({**cfg.to_dict(), "surprise": 1})


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
    assert _stat(Featurizer()("a = 1\n    # todo"), "last_line_is_comment") == 1.0


def test_tail_ngrams_add_features_only_when_enabled():
    text = "print('hello world')\n" * 20
    with_tail = Featurizer(FeatureConfig(tail_chars=64))(text)
    without = Featurizer(FeatureConfig(tail_chars=0))(text)
    assert with_tail.indices.size > without.indices.size
