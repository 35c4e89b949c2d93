"""Typed configuration: the embedded default, TOML files, TANDEM_* overrides and start-up error messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import PROJECT_ROOT, ConfigError, config_from_dict, load_config


def _minimal(**extra) -> dict:
    raw = {"engines": {"small": {"checkpoint": "ckpt/s"}, "large": {"checkpoint": "ckpt/l"}},
           "routes": {"fast": {"engines": ["small"]}}}
    raw.update(extra)
    return raw


def test_default_config_serves_two_tiny_models_behind_four_routes():
    cfg = load_config(env={})
    assert set(cfg.engines) == {"tandem-small", "tandem-large"}
    assert cfg.engines["tandem-small"].checkpoint == str(PROJECT_ROOT / "models" / "tandem-tiny-s")
    assert cfg.engines["tandem-large"].checkpoint == str(PROJECT_ROOT / "models" / "tandem-tiny-l")
    assert {n: (r.strategy, r.engines) for n, r in cfg.routes.items()} == {
        "fast": ("fixed", ["tandem-small"]), "best": ("fixed", ["tandem-large"]),
        "auto": ("router", ["tandem-small", "tandem-large"]),
        "cascade": ("cascade", ["tandem-small", "tandem-large"])}
    assert cfg.kv_pool.memory_bytes == 256 * 2**20
    assert cfg.auth.api_keys == [] and cfg.server.host == "127.0.0.1" and cfg.server.port == 8000
    assert cfg.telemetry.record_content is False


def test_toml_file_paths_resolve_relative_to_the_file(tmp_path: Path):
    (tmp_path / "conf").mkdir()
    file = tmp_path / "conf" / "tandem.toml"
    file.write_text('[engines.m]\ncheckpoint = "../models/m"\ndtype = "bfloat16"\n'
                    '[routes.r]\nengines = ["m"]\nslo = { ttft_ms = 250, tpot_ms = 20 }\n'
                    '[kv_pool]\nmemory_bytes = "1.5GiB"\n')
    cfg = load_config(file, env={})
    assert cfg.engines["m"].checkpoint == str(tmp_path / "models" / "m")
    assert cfg.engines["m"].dtype == "bfloat16"
    assert cfg.routes["r"].slo.ttft_ms == 250.0 and cfg.routes["r"].slo.percentile == 99.0
    assert cfg.kv_pool.memory_bytes == int(1.5 * 2**30)


def test_a_file_without_engines_overlays_the_embedded_default(tmp_path: Path):
    """A vLLM user's one-line file ([telemetry] metric_prefix = "vllm") tunes the default instead of failing
    "engines is empty"; its tables merge key by key, the default's paths still resolve to the project's models."""
    file = tmp_path / "t.toml"
    file.write_text('[telemetry]\nmetric_prefix = "vllm"\n[routes.fast]\nmax_tokens = 64\n')
    cfg = load_config(file, env={})
    default = load_config(env={})
    assert cfg.telemetry.metric_prefix == "vllm" and default.telemetry.metric_prefix == "tandem"
    assert cfg.telemetry.service_name == default.telemetry.service_name  # the rest of the table kept
    assert list(cfg.engines) == list(default.engines) and set(cfg.routes) == set(default.routes)
    assert cfg.engines["tandem-small"].checkpoint == str(PROJECT_ROOT / "models" / "tandem-tiny-s")
    assert cfg.routes["auto"].router.artifact == default.routes["auto"].router.artifact
    assert cfg.routes["fast"].max_tokens == 64 and cfg.routes["fast"].slo == default.routes["fast"].slo
    assert str(file) in cfg.source
    # a file that names engines replaces the default's engines and routes whole
    file.write_text('[telemetry]\nmetric_prefix = "vllm"\n[engines.only]\ncheckpoint = "/abs/only"\n')
    cfg = load_config(file, env={})
    assert list(cfg.engines) == ["only"] and cfg.routes == {}


def test_env_overrides_shortcuts_and_nested_keys_with_dashes():
    cfg = load_config(env={"TANDEM_API_KEYS": "k1, k2", "TANDEM_PORT": "9001",
                           "TANDEM_ENGINES__TANDEM_SMALL__DTYPE": "bfloat16",
                           "TANDEM_ROUTES__FAST__SLO__TTFT_MS": "123.5",
                           "TANDEM_AUTH__REQUESTS_PER_MINUTE": "60", "TANDEM_UNRELATED": "x"})
    assert cfg.auth.api_keys == ["k1", "k2"] and cfg.auth.requests_per_minute == 60
    assert cfg.server.port == 9001
    assert cfg.engines["tandem-small"].dtype == "bfloat16"  # the dash in the name matched the underscore
    assert cfg.routes["fast"].slo.ttft_ms == 123.5


def test_config_file_from_tandem_config_variable(tmp_path: Path):
    file = tmp_path / "t.toml"
    file.write_text('[engines.only]\ncheckpoint = "/abs/only"\n')
    cfg = load_config(env={"TANDEM_CONFIG": str(file)})
    assert list(cfg.engines) == ["only"] and cfg.engines["only"].checkpoint == "/abs/only"
    assert cfg.routes == {}


@pytest.mark.parametrize("env, expected", [
    ({"TANDEM_PORT": "http"}, "server.port = 'http' is invalid: expected an integer >= 0 and <= 65535"),
    ({"TANDEM_ENGINES__TANDEM_SMALL__DTYPE": "fp8"},
     "engines.tandem-small.dtype = 'fp8' is invalid: expected one of 'auto', 'bfloat16', 'float16', 'float32'"),
    ({"TANDEM_ENGINES__TANDEM_LARGE__MAX_NUM_SEQS": "0"},
     "engines.tandem-large.max_num_seqs = 0 is invalid: expected an integer >= 1"),
    ({"TANDEM_ROUTES__AUTO__STRATEGY": "magic"},
     "routes.auto.strategy = 'magic' is invalid: expected one of 'cascade', 'fixed', 'router'"),
    ({"TANDEM_KV_POOL__MEMORY_FRACTION": "1.5"},
     "kv_pool.memory_fraction = 1.5 is invalid: expected a number > 0 and <= 1"),
    ({"TANDEM_KV_POOL__BLOCKSIZE": "32"}, "unknown setting kv_pool.blocksize; allowed here: memory_bytes"),
    ({"TANDEM_NOPE__X": "1"}, "environment variable TANDEM_NOPE__X: unknown section 'nope'"),
    ({"TANDEM_KV_POOL__MEMORY_BYTES": "lots"}, "kv_pool.memory_bytes = 'lots' is invalid"),
])
def test_bad_values_name_the_field_the_value_and_what_is_allowed(env, expected):
    with pytest.raises(ConfigError) as info:
        load_config(env=env)
    assert expected in str(info.value)
    if "unknown section" not in expected:
        assert "from the environment" in str(info.value)  # the message says where the bad value came from


@pytest.mark.parametrize("raw, expected", [
    (_minimal(routes={"fast": {"engines": ["tiny"]}}),
     "routes.fast.engines contains 'tiny', an unknown engine; configured engines: ['large', 'small']"),
    (_minimal(engines={"small": {"checkpoint": "s"}, "large": {"checkpoint": "l", "draft": "medium"}}),
     "engines.large.draft = 'medium' names an unknown engine"),
    (_minimal(engines={"small": {"checkpoint": "s", "draft": "small"}}), "an engine cannot draft for itself"),
    (_minimal(engines={"small": {"checkpoint": "s", "num_speculative_tokens": 4}}),
     "engines.small.num_speculative_tokens = 4 needs engines.small.draft"),
    (_minimal(routes={"r": {"strategy": "router", "engines": ["small"]}}),
     "strategy 'router' takes exactly 2 engine(s) as [small, large]"),
    (_minimal(routes={"small": {"engines": ["small"]}}), "route name 'small' is also an engine name"),
    (_minimal(engines={"a": {"checkpoint": "a", "device": "cpu"}, "b": {"checkpoint": "b", "device": "cuda"}},
              routes={}), "engines use different devices ['cpu', 'cuda']"),
    (_minimal(engines={"a": {"checkpoint": "a", "device": "tpu"}}, routes={}),
     "engines.a.device = 'tpu' is invalid"),
    (_minimal(routes={"r": {"engines": ["small", "large"], "strategy": "router",
                            "router": {"threshold": 0.5, "target_large_fraction": 0.3}}}),
     "routes.r.router sets both threshold and target_large_fraction"),
    (_minimal(routes={"r": {"engines": ["small", "large"], "strategy": "router",
                            "router": {"window": 50, "warmup": 80}}}),
     "routes.r.router.warmup = 80 is above its window = 50"),
    (_minimal(routes={"r": {"engines": ["small", "large"], "strategy": "router",
                            "router": {"shadow_fraction": 0.75}}}),
     "routes.r.router.shadow_fraction = 0.75 is invalid: expected a number >= 0 and <= 0.5"),
    (_minimal(engines={}), "engines is empty"),
    (_minimal(engines={"a": {"dtype": "float32"}}, routes={}), "engines.a.checkpoint is required but missing"),
    (_minimal(auth={"api_keys": ["ok", {"key": "k2", "tokens_per_minute": -5}]}),
     "auth.api_keys[1].tokens_per_minute = -5 is invalid: expected an integer >= 1"),
])
def test_cross_checks_and_structure_errors(raw, expected):
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw, source="t.toml")
    assert expected in str(info.value)
    assert str(info.value).startswith("t.toml")


def test_per_key_limits_fall_back_to_section_defaults():
    cfg = config_from_dict(_minimal(auth={"api_keys": ["a", {"key": "b", "requests_per_minute": 5}],
                                          "requests_per_minute": 100, "tokens_per_minute": 1000}))
    keys = {k.key: (k.requests_per_minute, k.tokens_per_minute) for k in cfg.auth.keys()}
    assert keys == {"a": (100, 1000), "b": (5, 1000)}


def test_invalid_toml_and_missing_file_are_reported(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[engines\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(bad, env={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", env={})


def test_engine_core_args_map_every_field_onto_the_contract():
    cfg = config_from_dict({"engines": {
        "large": {"checkpoint": "/m/l", "draft": "small", "num_speculative_tokens": 3, "dtype": "bfloat16",
                  "quantization": "int8", "max_num_seqs": 8, "max_num_batched_tokens": 256,
                  "max_model_len": 1024, "attention_backend": "torch", "device": "cpu"},
        "small": {"checkpoint": "/m/s", "device": "cpu"}},
        "kv_pool": {"memory_bytes": 1 << 20, "block_size": 32, "enable_prefix_caching": False,
                    "kv_cache_dtype": "int8"}})
    from gateway.engine_setup import engine_core_args

    specs, pool, device = engine_core_args(cfg)
    assert device == "cpu"
    assert [s.name for s in specs] == ["small", "large"]  # the drafter is loaded first
    large = specs[1]
    assert (large.model, large.dtype, large.draft, large.num_speculative_tokens, large.quantization,
            large.max_num_seqs, large.max_num_batched_tokens, large.max_model_len, large.attention_backend) == (
        "/m/l", "bfloat16", "small", 3, "int8", 8, 256, 1024, "torch")
    assert (pool.memory_bytes, pool.block_size, pool.enable_prefix_caching, pool.kv_cache_dtype) == (
        1 << 20, 32, False, "int8")
