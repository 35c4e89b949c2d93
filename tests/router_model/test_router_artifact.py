"""Router artifacts: JSON + npz round trip with identical scores, no pickle, clear errors when tampered."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from router_model.data import parse_example
from router_model.features import FeatureConfig, HashBlock
from router_model.router import JSON_NAME, NPZ_NAME, MissingExtraFeature, Router, RouterArtifactError
from router_model.synthetic import synthetic_rows
from router_model.train import TrainOptions, train_router

PROMPTS = ["prove that the integral of sin 12 * 7", "hello there, cloud", "",
           [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "compute 3 * 4"}]]


def _train(extras: tuple[str, ...] = (), calibration: str = "sigmoid") -> Router:
    rows = synthetic_rows(240, seed=0)
    for i, r in enumerate(rows):
        r["extras"] = {"small_prompt_logprob": -1.0 - r["label"] + 0.01 * (i % 7)}
    examples = [parse_example(r, "r") for r in rows]
    blocks = (HashBlock("tail", 60, (1, 4), 512), HashBlock("tail", 0, (3, 5), 512))
    opts = TrainOptions(feature_config=FeatureConfig(blocks=blocks, extras=extras),
                        c_grid=(1.0,), folds=3, calibration=calibration)
    return train_router(examples, opts, log=lambda *_: None)


@pytest.fixture(scope="module")
def router() -> Router:
    return _train()


def test_round_trip_gives_identical_scores(router, tmp_path):
    router.save(tmp_path)
    loaded = Router.load(tmp_path)
    for p in PROMPTS:
        assert loaded.score(p) == router.score(p)
    assert loaded.threshold == router.threshold and loaded.feature_config == router.feature_config
    assert np.array_equal(loaded.score_quantiles, router.score_quantiles)


def test_isotonic_round_trip_gives_identical_scores(tmp_path):
    iso = _train(calibration="isotonic")
    iso.save(tmp_path)
    loaded = Router.load(tmp_path)
    assert [loaded.score(p) for p in PROMPTS] == [iso.score(p) for p in PROMPTS]


def test_npz_holds_plain_arrays_loadable_without_pickle(router, tmp_path):
    router.save(tmp_path)
    with np.load(tmp_path / NPZ_NAME, allow_pickle=False) as z:
        assert all(z[k].dtype != object for k in z.files)
    doc = json.loads((tmp_path / JSON_NAME).read_text())
    assert doc["format"] == "tandem-router" and doc["version"] == 2 and len(doc["npz_sha256"]) == 64
    assert doc["kind"] == "router" and doc["calibration"]["folds"] == 3


def test_tampered_weights_fail_with_a_checksum_error(router, tmp_path):
    router.save(tmp_path)
    with np.load(tmp_path / NPZ_NAME, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["coef"][0, 3] += 1.0
    np.savez_compressed(tmp_path / NPZ_NAME, **arrays)
    with pytest.raises(RouterArtifactError, match="sha256 .* does not match npz_sha256"):
        Router.load(tmp_path)


def test_wrong_version_fails_clearly(router, tmp_path):
    router.save(tmp_path)
    doc = json.loads((tmp_path / JSON_NAME).read_text())
    doc["version"] = 99
    (tmp_path / JSON_NAME).write_text(json.dumps(doc))
    with pytest.raises(RouterArtifactError, match=r"version 99 is not supported .* \(expects version 2\)"):
        Router.load(tmp_path)
    doc["version"] = 1  # the previous format (one model, hand-written hashing) is refused, not misread
    (tmp_path / JSON_NAME).write_text(json.dumps(doc))
    with pytest.raises(RouterArtifactError, match=r"version 1 is not supported"):
        Router.load(tmp_path)


def test_foreign_json_and_missing_files_fail_clearly(router, tmp_path):
    with pytest.raises(RouterArtifactError, match="router.json: missing"):
        Router.load(tmp_path)
    router.save(tmp_path)
    (tmp_path / JSON_NAME).write_text('{"format": "something-else"}')
    with pytest.raises(RouterArtifactError, match="not a tandem router artifact"):
        Router.load(tmp_path)


def test_feature_config_edit_that_breaks_shapes_fails_clearly(router, tmp_path):
    router.save(tmp_path)
    doc = json.loads((tmp_path / JSON_NAME).read_text())
    doc["feature_config"]["blocks"][0]["buckets"] = 1024
    (tmp_path / JSON_NAME).write_text(json.dumps(doc))
    with pytest.raises(RouterArtifactError, match="coef has shape"):
        Router.load(tmp_path)


def test_pickled_npz_is_refused(router, tmp_path):
    router.save(tmp_path)
    # an object array inside the npz needs pickle to load; the checksum is updated so only pickle can stop it
    with np.load(tmp_path / NPZ_NAME, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["intercept"] = np.array([object()] * arrays["intercept"].size, dtype=object)
    np.savez(tmp_path / NPZ_NAME, **arrays)
    import hashlib

    doc = json.loads((tmp_path / JSON_NAME).read_text())
    doc["npz_sha256"] = hashlib.sha256((tmp_path / NPZ_NAME).read_bytes()).hexdigest()
    (tmp_path / JSON_NAME).write_text(json.dumps(doc))
    assert zipfile.is_zipfile(tmp_path / NPZ_NAME)
    with pytest.raises(RouterArtifactError, match="malformed router artifact"):
        Router.load(tmp_path)


def test_router_with_an_extra_feature_needs_it_at_score_time(tmp_path):
    r = _train(extras=("small_prompt_logprob",))
    assert r.required_extras == ("small_prompt_logprob",)
    with pytest.raises(MissingExtraFeature, match="small_prompt_logprob"):
        r.score("hello")
    r.save(tmp_path)
    loaded = Router.load(tmp_path)
    assert loaded.score("hello", {"small_prompt_logprob": -2.0}) == r.score("hello", {"small_prompt_logprob": -2.0})
    # the extra carries the signal: a low prompt log-prob pushes towards large
    assert r.score("hello", {"small_prompt_logprob": -2.0}) > r.score("hello", {"small_prompt_logprob": -1.0})


def test_score_is_the_mean_of_the_calibrated_fold_models(router):
    feats = router.features(PROMPTS[0])
    z = router.margins_of(feats)
    assert z.shape == (3,)
    platt = 1.0 / (1.0 + np.exp(router.calibration.a * z + router.calibration.b))
    assert router.score(PROMPTS[0]) == pytest.approx(platt.mean())
    dense, hashed = router.featurizer.transform(PROMPTS)
    assert router.score_many(dense, hashed) == pytest.approx([router.score(p) for p in PROMPTS], abs=1e-12)


def test_decide_uses_the_artifact_threshold_unless_given_one(router):
    choice, score = router.decide(PROMPTS[0])
    assert choice == ("large" if score >= router.threshold else "small")
    assert router.decide(PROMPTS[0], threshold=0.0)[0] == "large"
    assert router.decide(PROMPTS[0], threshold=router.threshold_for_fraction(0.0))[0] == "small"
