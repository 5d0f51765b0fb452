"""ULTS: Algorithm 1 beliefs, Algorithm 2 on stored toy trees, KV reuse along paths, the build strategy."""

import json

import numpy as np
import pytest
import torch
from scipy import stats

from benchmarks.ults_toy import ToyTreeExpander, run_alpha, toy_params
from jobs.build_dataset import main
from pipeline.decoding.ults import (DirichletPrior, EmpiricalPrior, ULTSParams, _fit_beta, beam_search,
                                    fit_level_beliefs, ults_search)
from pipeline.engines.adapters import PathCacheExpander
from tests.conftest import GOOD_PROMPTS, write_jsonl


def test_beta_fit_is_the_two_parameter_mle():
    rng = np.random.default_rng(0)
    for a, b in [(0.3, 0.05), (2.7, 1.1), (5.0, 300.0)]:
        x = rng.beta(a, b, 2000)
        ours = _fit_beta(x)
        ref = stats.beta.fit(np.clip(x, 1e-12, 1 - 1e-12), floc=0, fscale=1)[:2]
        assert ours == pytest.approx(ref, rel=1e-4)


def test_log_space_dirichlet_matches_numpy_order_statistics():
    rng = np.random.default_rng(1)
    ours = DirichletPrior(0.3, 8).sample_sorted(20000, rng)
    ref = -np.sort(-rng.dirichlet(np.full(8, 0.3), 20000), axis=1)
    assert ours.sum(1) == pytest.approx(np.ones(20000))
    assert ours.mean(0) == pytest.approx(ref.mean(0), abs=0.01)
    # and the small-alpha regime where gamma draws underflow: still a distribution, peaked
    tiny = DirichletPrior(1e-4, 1000).sample_sorted(50, rng)
    assert np.all(np.isfinite(tiny)) and np.median(tiny[:, 0]) > 0.9


def test_level_beliefs_follow_algorithm_1_and_are_deterministic():
    prior = DirichletPrior(0.2, 8)
    beliefs = fit_level_beliefs(prior, 5, 2000, seed=3)
    # a pure function of (prior, depth, samples, seed): the engine's host keeps one fit per key
    np.testing.assert_array_equal(fit_level_beliefs(DirichletPrior(0.2, 8), 5, 2000, seed=3).params, beliefs.params)
    means = beliefs.params[1:, 0] / beliefs.params[1:, :].sum(1)
    assert np.all(np.diff(means) < 0)  # more tokens to go: a smaller best remaining likelihood
    # B_1 is the law of max_j c_j; B_2 that of max_j c_j * Delta_j: check against direct simulation
    rng = np.random.default_rng(9)
    c = rng.dirichlet(np.full(8, 0.2), (20000, 8))  # [n, child, b]
    delta2 = (rng.dirichlet(np.full(8, 0.2), 20000) * c.max(2)).max(1)
    assert means[0] == pytest.approx(c[:, 0].max(1).mean(), abs=0.01)
    assert means[1] == pytest.approx(delta2.mean(), abs=0.01)


def test_empirical_prior_beliefs_fit():
    probs = np.random.default_rng(0).dirichlet(np.full(16, 0.05), 200)
    beliefs = fit_level_beliefs(EmpiricalPrior(probs), 3, 500)
    assert beliefs.params.shape == (4, 2) and np.all(beliefs.params > 0)


def test_ults_with_small_epsilon_finds_the_optimum():
    beliefs = fit_level_beliefs(DirichletPrior(0.2, 8), 5, 1000)
    for k in range(5):
        toy = ToyTreeExpander(0.2, seed=100 + k)
        res = ults_search(toy, [[0]], beliefs, 5, toy_params(epsilon=1e-3), seeds=[k])[0]
        assert res.leaves[0][1] == pytest.approx(ToyTreeExpander(0.2, seed=100 + k).best_loglik(), abs=1e-6)
        assert len(res.leaves[0][0]) == 5


def test_ults_dominates_beam_search_on_toy_trees_alpha_0_1():
    """The paper's section 5.1 claim at alpha = 0.1, fixed seeds: every epsilon reaches a mean
    log-likelihood at least beam search's at the same number of expansions."""
    res = run_alpha(0.1, [0.05, 0.3], list(range(1, 8)), trees=30, seed=0)
    assert res["ults_dominates"], res
    for v in res["ults"].values():  # better than greedy, cheaper than width 2
        assert v["loglik"] > res["beam"][1]["loglik"] and v["expansions"] < res["beam"][2]["expansions"]


def test_k_max_caps_expansions_per_level_and_recursive_selection():
    beliefs = fit_level_beliefs(DirichletPrior(0.8, 8), 5, 1000)
    for acquisition in ("descendant", "posterior"):
        toy = ToyTreeExpander(0.8, seed=7)
        params = ULTSParams(epsilon=1e-6, k_max=2, branching=8, acquisition=acquisition)
        res = ults_search(toy, [[0]], beliefs, 5, params, seeds=[0])[0]
        assert res.expansions <= 1 + 2 * 4  # root, then at most k_max per level
        assert res.leaves and all(len(p) == 5 for p, _, _ in res.leaves)


class _EosToy(ToyTreeExpander):
    """A toy tree whose token 0 is EOS and very likely after the first step."""

    def expand(self, items):
        out = super().expand(items)
        out[:, 0] = np.log(0.9)
        return out


def test_eos_ends_a_leaf_and_is_not_in_the_tokens():
    beliefs = fit_level_beliefs(DirichletPrior(0.5, 8), 5, 500)
    res = ults_search(_EosToy(0.5, seed=1), [[0]], beliefs, 5, ULTSParams(epsilon=0.1, k_max=3, branching=8),
                      eos_ids={0}, min_leaves=2, seeds=[0])[0]
    tokens, logp, _ = res.leaves[0]
    assert len(tokens) == 1 and logp == pytest.approx(ToyTreeExpander(0.5, 1).levels[0][0][tokens[0]] + np.log(0.9))
    beam = beam_search(_EosToy(0.5, seed=1), [[0]], 5, 2, eos_ids={0})[0]
    assert len(beam.leaves[0][0]) == 1


def test_mean_score_is_length_normalised():
    beliefs = fit_level_beliefs(DirichletPrior(0.5, 8), 5, 500)
    params = ULTSParams(epsilon=0.1, k_max=3, branching=8, score="mean")
    res = ults_search(_EosToy(0.5, seed=1), [[0]], beliefs, 5, params, eos_ids={0}, min_leaves=2, seeds=[0])[0]
    for tokens, logp, score in res.leaves:
        assert score == pytest.approx(logp / (len(tokens) + (len(tokens) < 5)))


def test_path_cache_reuse_matches_full_prefix_forward(engine):
    model = engine.model
    expander = PathCacheExpander(model)
    p1, p2 = [1, 50, 60, 70, 80], [1, 90, 91]
    roots = expander.roots([p1, p2])
    step1 = expander.expand([(0, 1, 0, 100), (1, 1, 0, 101)])
    step2 = expander.expand([(0, 2, 1, 7), (1, 2, 1, 8), (0, 3, 0, 9)])  # mixed depths in one batch

    def ref(ids):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)

    for got, ids in [(roots[0], p1), (step1[0], p1 + [100]), (step1[1], p2 + [101]), (step2[0], p1 + [100, 7]),
                     (step2[1], p2 + [101, 8]), (step2[2], p1 + [9])]:
        assert torch.allclose(got, ref(ids), atol=1e-4)
    expander.release(0)
    assert all(key[0] == 1 for key in expander.entries)


def test_ults_build_strategy_in_process(tiny_models, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:2]])
    args = ["--config", "configs/demo.yaml", "--prompts", str(prompts), "--output", str(tmp_path / "out"),
            "--set", f"models.generator={tiny_models['generator']}", "--set", f"models.reward={tiny_models['reward']}",
            "--set", "runtime.local=true", "--max-new-tokens", "8", "--num-samples", "3", "--strategy", "ults",
            "--set", "strategy.k_max=3", "--no-progress"]
    assert main(args) == 0
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["pairs"] == 2 and manifest["config"]["strategy"]["name"] == "ults"
    assert 0 < manifest["generated_tokens"]


class _CountingToy(ToyTreeExpander):
    calls = 0

    def expand(self, items):
        self.calls += 1
        return super().expand(items)


def test_batched_expansion_of_several_nodes_and_trees_per_forward_pass():
    beliefs = fit_level_beliefs(DirichletPrior(0.5, 8), 5, 500)
    toy = _CountingToy(0.5, seed=3)
    optimum = toy.best_loglik()
    params = ULTSParams(epsilon=0.05, k_max=None, branching=8, expansions_per_step=3)
    results = ults_search(toy, [[0], [0]], beliefs, 5, params, seeds=[0, 1])
    expansions = sum(r.expansions for r in results)
    assert toy.calls < (expansions - 2) / 3 + 2  # two trees x up to three nodes per forward pass
    for r in results:
        tokens, logp, _ = r.leaves[0]
        assert len(tokens) == 5 and logp <= optimum + 1e-6


def test_ults_model_side_with_empirical_prior_returns_distinct_top_leaves(engine):
    from pipeline.decoding.sampling import SamplingParams
    from pipeline.decoding.ults import ULTSParams, search

    prompts = [engine.tokenizer(p).input_ids for p in GOOD_PROMPTS[:2]]
    params = ULTSParams(prior="empirical", empirical_samples=16, k_max=3, belief_samples=200)
    from pipeline.engines.adapters import HFSearchHost

    host = HFSearchHost(engine)
    outs = search(host, prompts, 3, list(range(6)), SamplingParams(max_new_tokens=6), params)
    # the empirical prior is the engine's: collected once, reused by the next batch
    prior = host.remember(("ults-empirical-prior", 16), lambda: None)
    assert prior is not None and 0 < prior.probs.shape[0] <= 16
    search(host, prompts[::-1], 3, list(range(6)), SamplingParams(max_new_tokens=6), params)
    assert host.remember(("ults-empirical-prior", 16), lambda: None) is prior
    assert [sorted(r.row for r in o.rows) for o in outs] == [[0, 1, 2], [3, 4, 5]]
    for out in outs:
        seqs = [tuple(r.token_ids) for r in out.rows]
        assert len(set(seqs)) == 3 and all(1 <= len(s) <= 6 for s in seqs)
        assert out.stats["expansions"] == out.generated_tokens <= 1 + 3 * 5


def test_ults_params_validate_selection_and_k_max():
    from pipeline.decoding.ults import ULTSParams
    from pipeline.errors import ConfigError

    assert ULTSParams(selection="boundary", k_max=None).k_max is None
    with pytest.raises(ConfigError, match="strategy.selection"):
        ULTSParams(selection="greedy")
    with pytest.raises(ConfigError, match="strategy.k_max"):
        ULTSParams(k_max=0)
