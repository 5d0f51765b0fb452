"""The configuration space users can set, searched by hypothesis on the tiny models, in-process.

Every registered method, with any combination of N, T, decision tokens (before, at and past T),
rejection rate, keep_lowest, memory-budget settings, prompts per batch, rows in flight and shard
size, either is refused by config validation (ConfigError, one line) or builds with every input row
accounted for and the pair invariants holding. Reward functions that return None, NaN, inf or a
constant for partial or for final responses (tests/reward_functions.py) are searched too: an absent
partial reward never quarantines a candidate, a non-finite final one always does, and the counts
add up. Examples hypothesis found are kept below as plain tests (test_found_*).
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import ConfigError, config_from_dict
from pipeline.strategies import STRATEGIES
from tests import reward_functions
from tests.conftest import MIXED_BAD_ROWS, MIXED_ROWS, write_jsonl

pytestmark = pytest.mark.slow

# Sample-based methods: each candidate is its own sequence, so a prompt costs at least the tokens
# of its chosen and rejected responses together (tree searches share prefixes between candidates).
SAMPLE_BASED = {"best_of_n", "sbon", "aded"}


@pytest.fixture(scope="module")
def space(tiny_models, tmp_path_factory):
    """Models (the tiny ones, plus a Reward Transformer with a channel for SLA), a prompt file of
    good and bad rows, and in-process workers cached per (method, continuous batching): loading models
    is most of a tiny build's cost, and a worker serves any number of builds."""
    from pipeline.engines.hf import load_tokenizer
    from pipeline.engines.reward_transformer import RewardTransformer

    tmp = tmp_path_factory.mktemp("space")
    rt = RewardTransformer.from_pretrained(str(tiny_models["generator"]), hidden_size=16)
    rt.channel.config.trained = True  # untrained weights: SLA's search runs all the same
    rt.save_pretrained(str(tmp / "rt"), load_tokenizer(str(tiny_models["generator"])))
    prompts = write_jsonl(tmp / "prompts.jsonl", MIXED_ROWS)
    space = Space({"models": tiny_models, "rt": tmp / "rt", "prompts": prompts, "workers": {}})
    yield space
    for w in space["workers"].values():
        w.shutdown()


class Space(dict):
    def __repr__(self) -> str:  # hypothesis prints the fixture with each failing example
        return "space"


def reward_spec(space: dict, reward: str | None) -> str:
    """A function of tests/reward_functions.py by name; None: the tiny reward model."""
    return f"tests.reward_functions:{reward}" if reward else str(space["models"]["reward"])


def make_config(space: dict, name: str, output: Path, num_samples: int, max_new_tokens: int, params: dict,
                runtime: dict, shard_size: int, reward: str | list | None = None, weights: list | None = None) -> object:
    """``reward``: a function of tests/reward_functions.py by name, None: the tiny reward model, or a
    list of those (a composite reward, with ``weights``)."""
    models = space["models"]
    raw = {
        "models": {"generator": str(space["rt"] if name == "sla" else models["generator"]),
                   "reward": [reward_spec(space, r) for r in reward] if isinstance(reward, list)
                   else reward_spec(space, reward),
                   "reward_weights": weights,
                   "draft": str(models["draft"])},
        "strategy": {"name": name, **params},
        "sampling": {"num_samples": num_samples, "max_new_tokens": max_new_tokens, "top_p": 0.95},
        "data": {"prompts": str(space["prompts"]), "output": str(output), "shard_size": shard_size},
        "runtime": {"local": True, **runtime},
        "seed": 0,
    }
    return config_from_dict(raw)


def build(space: dict, config) -> dict:
    """plan_build + run_build with cached in-process workers; returns the manifest."""
    from actors import start_workers
    from pipeline.build import plan_build, run_build

    key = (config.strategy.name, config.runtime.continuous_batching, config.models.generator,
           tuple(config.models.rewards), tuple(config.models.weights))
    if key not in space["workers"]:
        space["workers"][key] = start_workers(config)
    plan = plan_build(config)
    return run_build(plan, space["workers"][key], progress=False)


def check_output(output: Path, config, manifest: dict) -> None:
    """Every input row is a pair or a reject, exactly once; the pair invariants hold."""
    pairs = [r for p in sorted(output.glob("train-*.parquet")) for r in pq.read_table(p).to_pylist()]
    rejects = [r for p in sorted((output / "_rejects").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
    rows = sorted([p["source_row"] for p in pairs] + [r["source_row"] for r in rejects])
    assert rows == list(range(len(MIXED_ROWS))), "every input row exactly once, as a pair or a reject"
    assert {r["source_row"] for r in rejects} >= set(MIXED_BAD_ROWS)
    assert manifest["pairs"] == len(pairs) and manifest["prompts_rejected"] == len(rejects)
    cap = config.sampling.max_new_tokens
    for p in pairs:
        assert p["chosen_score"] > p["rejected_score"], p
        assert math.isfinite(p["chosen_score"]) and math.isfinite(p["rejected_score"])
        assert not p["rejected_is_partial"], "data.rejected: complete (the default) never pairs a partial response"
        assert p["num_candidates"] == config.sampling.num_samples
        assert 0 < len(p["chosen_token_ids"]) <= cap and 0 < len(p["rejected_token_ids"]) <= cap
        floor = (len(p["chosen_token_ids"]) + len(p["rejected_token_ids"]) if config.strategy.name in SAMPLE_BASED
                 else max(len(p["chosen_token_ids"]), len(p["rejected_token_ids"])))
        assert p["generated_tokens"] >= floor, p
        if config.strategy.name in ("best_of_n", "sbon"):
            assert p["bon_equivalent_tokens"] <= config.sampling.num_samples * cap
    generated = sum(p["generated_tokens"] for p in pairs) + sum(r["generated_tokens"] for r in rejects)
    assert manifest["generated_tokens"] == generated
    if config.strategy.name == "sbon":
        taus = config.strategy.params.decision_tokens
        if all(t >= cap for t in taus):  # no decision point: plain Best-of-N
            assert all(p["stopped_early"] == 0 for p in pairs)
            assert all(p["generated_tokens"] == p["bon_equivalent_tokens"] for p in pairs)


def check_rewards(output: Path, config, manifest: dict, reward: str) -> None:
    """With reward function ``reward``: only candidates whose final reward is non-finite are
    quarantined (never one stopped early: an absent partial reward keeps its row live), every such
    candidate is, and the counts add up."""
    pairs = [r for p in sorted(output.glob("train-*.parquet")) for r in pq.read_table(p).to_pylist()]
    rejects = [r for p in sorted((output / "_rejects").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
    quarantine = [r for p in sorted((output / "_quarantine").glob("part-*.parquet"))
                  for r in pq.read_table(p).to_pylist()]
    generated = [r for r in rejects if r["stage"] != "input"] + pairs  # the prompts that reached the strategy
    assert manifest["candidates"] == len(generated) * config.sampling.num_samples
    assert manifest["candidates_quarantined"] == len(quarantine) <= manifest["candidates"]
    for q in quarantine:
        assert not q["stopped_early"], f"a partial reward quarantined a candidate: {q}"
        assert not reward_functions.final_is_finite(reward, q["text"]), f"a finite final reward quarantined: {q}"
    if reward in reward_functions.FINAL_ALWAYS_FINITE:
        assert not quarantine
    if reward in reward_functions.FINAL_NEVER_FINITE:
        assert not pairs
        # every prompt finished at least one candidate (sbon keeps at least one row per prompt going)
        assert {q["source_row"] for q in quarantine} == {r["source_row"] for r in generated}
        if config.strategy.name == "best_of_n":
            assert len(quarantine) == manifest["candidates"]
    for p in pairs:  # a pair's failed candidates are its quarantined ones
        assert p["failed_candidates"] == sum(q["source_row"] == p["source_row"] for q in quarantine)
        for side in ("chosen", "rejected"):
            assert reward_functions.final_is_finite(reward, p[side])
    if reward in ("constant_final", "constant_always"):
        assert not pairs  # best and worst tie
    if reward in ("none_partial", "nan_partial", "inf_partial", "none_always"):
        # no row could be ranked at a decision token: none was stopped, and without memory-budget
        # mode's extra rows (screened out after they finish) the cost is Best-of-N's exactly
        assert all(p["stopped_early"] == 0 for p in pairs)
        if getattr(config.strategy.params, "initial_candidates", None) in (None, config.sampling.num_samples):
            assert all(r["generated_tokens"] == r["bon_equivalent_tokens"] for r in pairs + rejects)


def run_case(space, name, num_samples, max_new_tokens, params, runtime, shard_size, reward=None) -> str:
    """Build one configuration (``reward``: a function of tests/reward_functions.py, or None: the
    tiny reward model); returns "refused" or "built"."""
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "out"
        try:
            config = make_config(space, name, output, num_samples, max_new_tokens, params, runtime, shard_size,
                                 reward)
        except ConfigError as exc:
            assert "\n" not in str(exc)
            return "refused"
        manifest = build(space, config)
        check_output(output, config, manifest)
        if reward:
            check_rewards(output, config, manifest, reward)
        assert json.loads((output / "_manifest.json").read_text())["pairs"] == manifest["pairs"]
    return "built"


# -- the space -------------------------------------------------------------------------------

taus = st.integers(1, 20)
runtime_settings = st.fixed_dictionaries({
    "prompts_per_batch": st.integers(1, 4),
    "batches_in_flight": st.integers(1, 4),
    "rows_in_flight": st.sampled_from([0, 1, 4, 64]),
    "continuous_batching": st.booleans(),
    "reward_cache_mb": st.sampled_from([0, 256]),  # 0: every streamed row is read in full again
})
common = dict(num_samples=st.integers(2, 5), max_new_tokens=st.integers(1, 14), runtime=runtime_settings,
              shard_size=st.integers(1, 13))
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True, print_blob=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

sbon_params = st.fixed_dictionaries({
    "decision_token": st.one_of(taus, st.lists(taus, min_size=1, max_size=3)),
    "rejection_rate": st.floats(0, 0.95),
    "keep_lowest": st.booleans(),
}, optional={
    "initial_candidates": st.one_of(st.integers(1, 8), st.just("auto")),
    "max_live_candidates": st.integers(1, 8),
    "adaptive_rejection": st.floats(0.1, 3),
})


@SETTINGS
@given(params=sbon_params, **common)
def test_sbon_space(space, params, num_samples, max_new_tokens, runtime, shard_size):
    run_case(space, "sbon", num_samples, max_new_tokens, params, runtime, shard_size)


@SETTINGS
@given(**common)
def test_best_of_n_space(space, num_samples, max_new_tokens, runtime, shard_size):
    run_case(space, "best_of_n", num_samples, max_new_tokens, {}, runtime, shard_size)


reward_names = st.sampled_from(reward_functions.ALL)


@settings(SETTINGS, max_examples=24)
@given(params=sbon_params, reward=reward_names, **common)
def test_sbon_reward_function_space(space, params, reward, num_samples, max_new_tokens, runtime, shard_size):
    """Issue 36, item 9: partial and final rewards that are None, NaN, inf or constant."""
    run_case(space, "sbon", num_samples, max_new_tokens, params, runtime, shard_size, reward)


@SETTINGS
@given(reward=reward_names, **common)
def test_best_of_n_reward_function_space(space, reward, num_samples, max_new_tokens, runtime, shard_size):
    run_case(space, "best_of_n", num_samples, max_new_tokens, {}, runtime, shard_size, reward)


MODEL_SIDE_PARAMS = {
    "ults": st.fixed_dictionaries({}, optional={"k_max": st.one_of(st.none(), st.integers(1, 4)),
                                                "branching": st.integers(1, 4),
                                                "epsilon": st.floats(0.01, 0.9),
                                                "expansions_per_step": st.integers(1, 3)}),
    "aded": st.fixed_dictionaries({}, optional={"draft_depth": st.integers(1, 5), "candidates": st.integers(1, 8),
                                                "iterations": st.integers(1, 40), "top_t": st.integers(1, 12)}),
    "sla": st.fixed_dictionaries({}, optional={"search_depth": st.integers(1, 3), "search_width": st.integers(1, 3),
                                               "step_size": st.integers(1, 8)}),
    "dsbd": st.fixed_dictionaries({}, optional={"draft_width": st.integers(1, 4),
                                                "num_draft_layers": st.integers(1, 3),
                                                "acceptance_threshold": st.floats(0.05, 1.0),
                                                "memory_mode": st.booleans()}),
}


def test_every_registered_method_is_searched():
    assert set(STRATEGIES) == {"sbon", "best_of_n", *MODEL_SIDE_PARAMS}


@pytest.mark.parametrize("name", sorted(MODEL_SIDE_PARAMS))
def test_model_side_space(space, name):
    @SETTINGS
    @given(params=MODEL_SIDE_PARAMS[name], **common)
    def case(params, num_samples, max_new_tokens, runtime, shard_size):
        run_case(space, name, num_samples, max_new_tokens, params, runtime, shard_size)

    case()


# -- examples hypothesis found, kept as regular tests ----------------------------------------

FOUND = [
    # issue 27: every decision token at or past max_new_tokens crashed with KeyError: 0.
    ("sbon", 4, 16, {"decision_token": 16}, {}, 8, "built"),
    ("sbon", 3, 6, {"decision_token": [6, 9]}, {}, 4, "built"),
    ("sbon", 3, 1, {"decision_token": 1, "keep_lowest": False}, {"continuous_batching": False}, 1, "built"),
    # hypothesis: initial_candidates < num_samples raised ValueError mid-build; now refused by config.
    ("sbon", 5, 8, {"decision_token": 4, "initial_candidates": 2}, {}, 3, "refused"),
    # hypothesis: memory-budget mode with no decision point started initial_candidates rows and
    # counted the screened ones' tokens; now plain Best-of-N.
    ("sbon", 2, 1, {"decision_token": 1, "rejection_rate": 0.0, "keep_lowest": False, "initial_candidates": 3},
     {"prompts_per_batch": 1, "batches_in_flight": 1, "rows_in_flight": 0, "continuous_batching": False}, 1, "built"),
    # memory-budget mode with keep_lowest (tests/test_decoding.py checks that exactly the budget goes on).
    ("sbon", 4, 12, {"decision_token": 3, "initial_candidates": 6, "max_live_candidates": 2}, {}, 4, "built"),
    # issue 48: memory-budget mode sized by the KV pool (auto), with and without a row limit.
    ("sbon", 3, 10, {"decision_token": 3, "initial_candidates": "auto", "max_live_candidates": 2},
     {"rows_in_flight": 16}, 4, "built"),
    ("sbon", 2, 6, {"decision_token": 2, "initial_candidates": "auto"},
     {"prompts_per_batch": 2, "batches_in_flight": 4, "rows_in_flight": 0}, 3, "built"),
]


@pytest.mark.parametrize("name, num_samples, max_new_tokens, params, runtime, shard_size, outcome", FOUND)
def test_found(space, name, num_samples, max_new_tokens, params, runtime, shard_size, outcome):
    assert run_case(space, name, num_samples, max_new_tokens, params, runtime, shard_size) == outcome


FOUND_WITH_REWARDS = [
    # issue 36: None for every partial response quarantined every live row at tau (1 pair in 24).
    ("sbon", 4, 16, {"decision_token": 8}, {}, 4, "none_partial"),
    ("sbon", 4, 16, {"decision_token": [4, 8], "initial_candidates": 6, "max_live_candidates": 2}, {}, 4,
     "nan_partial_sometimes"),
    ("sbon", 3, 12, {"decision_token": 4, "adaptive_rejection": 1.0}, {}, 4, "none_partial_sometimes"),
    ("sbon", 4, 12, {"decision_token": 4}, {}, 4, "none_final"),
]


@pytest.mark.parametrize("name, num_samples, max_new_tokens, params, runtime, shard_size, reward", FOUND_WITH_REWARDS)
def test_found_with_rewards(space, name, num_samples, max_new_tokens, params, runtime, shard_size, reward):
    assert run_case(space, name, num_samples, max_new_tokens, params, runtime, shard_size, reward) == "built"


def check_composite(output: Path, config, rewards: list) -> None:
    """Every pair keeps each reward's score; chosen_score and rejected_score are their weighted sums;
    a function's score is the function's own on the final text."""
    pairs = [r for p in sorted(output.glob("train-*.parquet")) for r in pq.read_table(p).to_pylist()]
    weights = config.models.weights
    for p in pairs:
        for side in ("chosen", "rejected"):
            parts = p[f"{side}_scores"]
            assert len(parts) == len(rewards) and all(math.isfinite(v) for v in parts)
            assert p[f"{side}_score"] == pytest.approx(sum(w * v for w, v in zip(weights, parts)), rel=1e-4, abs=1e-4)
            for name, value in zip(rewards, parts):
                if name is not None:
                    fn = getattr(reward_functions, name)
                    assert value == fn([p["raw_prompt"]], [p[side]], partial=[False])[0]


composite_rewards = st.lists(st.sampled_from([None, *reward_functions.ALL]), min_size=1, max_size=3, unique=True)


@settings(SETTINGS, max_examples=16)
@given(strategy=st.sampled_from(["sbon", "best_of_n"]), params=sbon_params, rewards=composite_rewards,
       data=st.data(), **common)
def test_composite_reward_space(space, strategy, params, rewards, data, num_samples, max_new_tokens, runtime,
                                shard_size):
    """Issue 37: models.reward as a list of the tiny reward model and reward functions that may say
    nothing (None, NaN, inf) or tie, with weights (or none): built or refused in one line, never lost
    or mixed, and the pairs keep each reward's score."""
    weights = data.draw(st.one_of(st.none(), st.lists(st.sampled_from([-1.0, 0.0, 0.25, 1.0, 3.0]),
                                                      min_size=len(rewards), max_size=len(rewards))))
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "out"
        try:
            config = make_config(space, strategy, output, num_samples, max_new_tokens,
                                 params if strategy == "sbon" else {}, runtime, shard_size, rewards, weights)
        except ConfigError as exc:  # all-zero weights, or strategy parameters refused as in test_sbon_space
            assert "\n" not in str(exc)
            assert (weights is not None and not any(weights)) or str(exc).startswith("strategy."), str(exc)
            return
        manifest = build(space, config)
        check_output(output, config, manifest)
        check_composite(output, config, rewards)
