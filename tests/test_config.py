import pytest

from pipeline.config import ConfigError, config_from_dict, load_config
from pipeline.decoding.speculative_rejection import SpeculativeRejectionParams


def test_demo_config_loads_with_overrides():
    cfg = load_config("configs/demo.yaml", ["strategy.rejection_rate=0.7", "sampling.num_samples=4",
                                            "models.generator=/x/gen"])
    assert cfg.strategy.name == "sbon"
    assert isinstance(cfg.strategy.params, SpeculativeRejectionParams)
    assert cfg.strategy.params.rejection_rate == 0.7
    assert cfg.sampling.num_samples == 4
    assert cfg.models.generator == "/x/gen"
    flat = cfg.to_dict()
    assert flat["strategy"] == {"name": "sbon", "decision_token": 16, "rejection_rate": 0.7,
                                "initial_candidates": None, "max_live_candidates": None,
                                "adaptive_rejection": None, "streaming_rewards": True, "keep_lowest": True,
                                "partial_reward": "scorer"}


@pytest.mark.parametrize("raw, key", [
    ({"sampling": {"num_sampels": 4}}, "sampling.num_sampels"),
    ({"strategy": {"name": "sbon", "tau": 4}}, "strategy.tau"),
    ({"strategy": {"name": "best_of_n", "rejection_rate": 0.5}}, "strategy.rejection_rate"),
    ({"bogus": 1}, "config.bogus"),
    ({"runtime": {"generator": {"gpus": 1}}}, "config.runtime.generator.gpus"),
])
def test_unknown_keys_are_named(raw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_dict(raw)


@pytest.mark.parametrize("raw, needle", [
    ({"sampling": {"num_samples": "eight"}}, "sampling.num_samples"),
    ({"sampling": {"num_samples": 1}}, "at least 2"),
    ({"strategy": {"name": "sbon", "rejection_rate": 1.0}}, "rejection_rate"),
    ({"strategy": {"name": "sbon", "decision_token": [8, 0]}}, "decision_token"),
    ({"strategy": {"name": "nope"}}, "unknown strategy"),
    ({"data": {"overlength": "drop"}}, "data.overlength"),
    ({"sampling": {"top_p": 0}}, "top_p"),
    ({"models": {"backend": "vllm"}, "strategy": {"name": "dsbd"}}, "vllm serves"),
])
def test_invalid_values_are_rejected(raw, needle):
    with pytest.raises(ConfigError, match=needle):
        config_from_dict(raw)


def test_decision_token_list_and_int_coercion():
    cfg = config_from_dict({"strategy": {"name": "sbon", "decision_token": [32, 8, 8]},
                            "runtime": {"generator": {"num_cpus": 2}}})
    assert cfg.strategy.params.decision_tokens == [8, 32]
    assert cfg.runtime.generator.num_cpus == 2.0


def test_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(str(bad))


def test_merged_decoding_is_read_as_continuous_batching_with_a_warning(caplog):
    """runtime.merged_decoding (the old name) still works: a warning line, and the value lands on
    runtime.continuous_batching; both set differently is an error naming the old key."""
    with caplog.at_level("WARNING", logger="pipeline.config"):
        cfg = config_from_dict({"runtime": {"merged_decoding": False}})
    assert cfg.runtime.continuous_batching is False
    assert "runtime.merged_decoding is renamed runtime.continuous_batching" in caplog.text
    assert not hasattr(cfg.runtime, "merged_decoding")
    assert config_from_dict({"runtime": {"merged_decoding": True, "continuous_batching": True}}).runtime.continuous_batching
    with pytest.raises(ConfigError, match=r"runtime\.merged_decoding: renamed runtime\.continuous_batching"):
        config_from_dict({"runtime": {"merged_decoding": False, "continuous_batching": True}})
    assert load_config(None, ["runtime.merged_decoding=false"]).runtime.continuous_batching is False
    assert "merged_decoding" not in cfg.to_dict()["runtime"]


def test_backends_come_from_the_backend_registry():
    from pipeline.engines.backends import BACKENDS
    from pipeline.strategies import STRATEGIES

    with pytest.raises(ConfigError, match="models.backend: expected hf or vllm, got 'tgi'"):
        config_from_dict({"models": {"backend": "tgi"}})
    with pytest.raises(ConfigError, match="models.reward_backend"):
        config_from_dict({"models": {"reward_backend": "tgi"}})
    for name, record in STRATEGIES.items():
        for backend in BACKENDS:
            raw = {"strategy": {"name": name}, "models": {"backend": backend}}
            if backend in record.backends:
                assert config_from_dict(raw).models.backend == backend
            else:
                with pytest.raises(ConfigError, match=f"serves .* only, not strategy '{name}'"):
                    config_from_dict(raw)
