"""ULTS: Algorithm 1 beliefs, Algorithm 2 on stored toy trees, KV reuse along paths, the build strategy."""

import json

import numpy as np
import pytest
import torch
from scipy import stats

from benchmarks.ults_toy import ToyTreeExpander, run_alpha, toy_params
from jobs.build_dataset import main
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.ults import (DirichletPrior, EmpiricalPrior, ULTSParams, _fit_beta, beam_search,
                                    collect_softmax, fit_level_beliefs, search, ults_search)
from pipeline.engines.adapters import PathCacheExpander
from tests.bigram_models import HostState
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


def _toy_top(toy: ToyTreeExpander, n: int) -> list[tuple[list[int], float]]:
    """The n most likely leaves of a stored toy tree by brute force over all b^depth of them."""
    totals = np.zeros(1)
    for level in toy.levels:  # level l: [b^l, b]; leaf index = base-b digits of the path
        totals = (totals[:, None] + level).reshape(-1)
    best = np.argsort(-totals, kind="stable")[:n]
    depth = len(toy.levels)
    return [([int(i) // toy.b ** (depth - 1 - d) % toy.b for d in range(depth)], float(totals[i])) for i in best]


def test_batched_expansion_of_several_nodes_and_trees_per_forward_pass():
    """Two trees, three nodes each per forward pass, three candidates wanted: each tree's leaves are
    exactly the three most likely of its 8^5, found by brute force."""
    beliefs = fit_level_beliefs(DirichletPrior(0.5, 8), 5, 500)
    toy = _CountingToy(0.5, seed=3)
    truth = _toy_top(toy, 3)
    params = ULTSParams(epsilon=0.05, k_max=None, branching=8, expansions_per_step=3)
    results = ults_search(toy, [[0], [0]], beliefs, 5, params, min_leaves=3, seeds=[0, 1])
    expansions = sum(r.expansions for r in results)
    assert toy.calls < (expansions - 2) / 3 + 2  # two trees x up to three nodes per forward pass
    for r in results:
        assert [tokens for tokens, _, _ in r.leaves[:3]] == [tokens for tokens, _ in truth]
        assert [logp for _, logp, _ in r.leaves[:3]] == pytest.approx([logp for _, logp in truth], abs=1e-5)


def test_ults_model_side_with_empirical_prior_returns_distinct_top_leaves(engine):
    from pipeline.engines.adapters import HFSearchHost

    prompts = [engine.tokenizer(p).input_ids for p in GOOD_PROMPTS[:2]]
    params = ULTSParams(prior="empirical", empirical_samples=16, k_max=3, belief_samples=200)
    outs = search(HFSearchHost(engine), prompts, 3, list(range(6)), SamplingParams(max_new_tokens=6), params)
    assert [sorted(r.row for r in o.rows) for o in outs] == [[0, 1, 2], [3, 4, 5]]
    for out in outs:
        seqs = [tuple(r.token_ids) for r in out.rows]
        assert len(set(seqs)) == 3 and all(1 <= len(s) <= 6 for s in seqs)
        assert out.stats["expansions"] <= 1 + 3 * 6  # k_max expansions per level
        # 16 vectors: 3 rollouts side by side for ceil(16 / 3) = 6 steps, a token each after the first
        assert 0 < out.stats["prior_tokens"] <= 5 * 3
        assert out.generated_tokens == out.stats["expansions"] + out.stats["prior_tokens"]


def _rows(outs) -> list[list[tuple]]:
    return [[(r.row % 3, tuple(r.token_ids), r.text) for r in o.rows] for o in outs]


def test_empirical_prior_is_a_function_of_the_prompt_alone(engine):
    """Reproducible candidates (issue 12, item 9): the same prompt gets the same candidates batched alone or with others, first or after
    another batch on the same engine: its empirical prior comes from its own rollouts and seed."""
    from pipeline.engines.adapters import HFSearchHost

    p0, p1 = (engine.tokenizer(p).input_ids for p in GOOD_PROMPTS[:2])
    params = ULTSParams(prior="empirical", empirical_samples=12, k_max=3, belief_samples=200, branching=3)
    sampling = SamplingParams(max_new_tokens=6)
    seeds0, seeds1 = [11, 12, 13], [21, 22, 23]
    alone = [search(HFSearchHost(engine), [p], 3, seeds, sampling, params)[0]
             for p, seeds in ((p0, seeds0), (p1, seeds1))]
    host = HFSearchHost(engine)
    first = search(host, [p1], 3, seeds1, sampling, params)  # this batch came first on the engine
    together = search(host, [p0, p1], 3, seeds0 + seeds1, sampling, params)
    assert _rows(together) == _rows(alone)
    assert _rows(first) == _rows(alone[1:])
    for a, b in zip(together, alone):  # the batched forward pass may move the last float bits
        assert {k: v for k, v in a.stats.items() if k != "best_loglik"} == {
            k: v for k, v in b.stats.items() if k != "best_loglik"}
        assert a.stats["best_loglik"] == pytest.approx(b.stats["best_loglik"], rel=1e-6)


class _PathModel:
    """A tiny enumerable language model (NodeExpander): the next-token distribution after a context
    (prompt + path) is a Dirichlet(alpha) draw seeded by the context; the EOS ids, if any, share
    ``eos_mass`` of it (each a fixed part), the other tokens the rest."""

    def __init__(self, vocab: int, alpha: float, seed: int, eos_ids=(), eos_mass: float = 0.0):
        self.vocab, self.alpha, self.seed = vocab, alpha, seed
        self.eos_ids, self.eos_mass = sorted(eos_ids), eos_mass
        self.context: dict[tuple[int, int], tuple[int, ...]] = {}

    def logprobs(self, context: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng([self.seed, len(context), *context])
        probs = rng.dirichlet(np.full(self.vocab, self.alpha))
        if self.eos_ids:
            probs[self.eos_ids] = 0.0
            probs *= (1 - self.eos_mass) / probs.sum()
            probs[self.eos_ids] = self.eos_mass * rng.dirichlet(np.full(len(self.eos_ids), 2.0))
        return np.log(np.clip(probs, 1e-300, 1))

    def roots(self, prompts):
        for t, prompt in enumerate(prompts):
            self.context[(t, 0)] = tuple(prompt)
        return torch.tensor(np.stack([self.logprobs(tuple(p)) for p in prompts]))

    def expand(self, items):
        rows = []
        for tree, node, parent, token in items:
            self.context[(tree, node)] = self.context[(tree, parent)] + (token,)
            rows.append(self.logprobs(self.context[(tree, node)]))
        return torch.tensor(np.stack(rows))

    def release(self, tree):
        for key in [k for k in self.context if k[0] == tree]:
            del self.context[key]

    def responses(self, prompt: list[int], depth: int) -> dict[tuple[int, ...], float]:
        """Every distinct response (EOS stripped) of at most ``depth`` tokens and its log-likelihood:
        a response that ends at EOS takes its most likely EOS token, as the search keeps it."""
        out: dict[tuple[int, ...], float] = {}

        def walk(path: tuple[int, ...], logp: float):
            lp = self.logprobs(tuple(prompt) + path)
            if self.eos_ids:
                out[path] = logp + max(lp[e] for e in self.eos_ids)
            for tok in range(self.vocab):
                if tok in self.eos_ids:
                    continue
                if len(path) + 1 == depth:
                    out[path + (tok,)] = logp + lp[tok]
                else:
                    walk(path + (tok,), logp + lp[tok])

        walk((), 0.0)
        return out

    def top(self, prompt: list[int], depth: int, n: int) -> list[tuple[list[int], float]]:
        ranked = sorted(self.responses(prompt, depth).items(), key=lambda kv: -kv[1])[:n]
        return [(list(tokens), logp) for tokens, logp in ranked]


class _FakeHost(HostState):
    """ULTSHost over a _PathModel."""

    def __init__(self, model: _PathModel):
        super().__init__()
        self.model, self.eos_ids, self.vocab_size = model, set(model.eos_ids), model.vocab

    def node_expander(self):
        return self.model


@pytest.mark.parametrize("acquisition", ["descendant", "posterior"])
@pytest.mark.parametrize("eos_ids", [(), (0, 1)], ids=["no_eos", "two_eos"])
def test_candidates_are_the_exact_top_n_responses(acquisition, eos_ids):
    """With an optimistic prior (alpha = 1e-4: the best remaining likelihood is believed near 1, so
    v_x is about the path likelihood, an upper bound) and no k_max cap, the search may stop only
    once nothing unexplored can beat the n-th candidate: the n candidates are exactly the n most
    likely distinct responses, found by enumerating all of them."""
    depth, n = 4, 4
    beliefs = fit_level_beliefs(DirichletPrior(1e-4, 5), depth, 500)
    params = ULTSParams(epsilon=0.1, k_max=None, branching=n, belief_samples=500, acquisition=acquisition)
    for seed in range(3):
        model = _PathModel(5, 0.5, seed, eos_ids, eos_mass=0.3)
        prompts = [[7], [8]]
        results = ults_search(model, prompts, beliefs, depth, params, set(eos_ids), min_leaves=n, seeds=[0, 1])
        for prompt, res in zip(prompts, results):
            truth = model.top(prompt, depth, n)
            assert [tokens for tokens, _, _ in res.leaves[:n]] == [tokens for tokens, _ in truth], (seed, prompt)
            assert [logp for _, logp, _ in res.leaves[:n]] == pytest.approx([logp for _, logp in truth], abs=1e-5)


def test_several_eos_ids_end_one_response_each():
    """[.., a, eos1] and [.., a, eos2] are one response: the leaves are distinct once EOS is
    stripped, each EOS-ended one with its more likely EOS, and each expansion still offers
    ``branching`` distinct children."""
    model = _PathModel(6, 0.5, 0, eos_ids=(0, 1), eos_mass=0.9)
    beliefs = fit_level_beliefs(DirichletPrior(1e-4, 6), 4, 300)
    params = ULTSParams(epsilon=0.1, k_max=5, branching=3, belief_samples=300)
    res = ults_search(model, [[3]], beliefs, 4, params, {0, 1}, min_leaves=3, seeds=[0])[0]
    tokens = [tuple(t) for t, _, _ in res.leaves]
    assert len(tokens) >= 3 and len(set(tokens)) == len(tokens)
    truth = model.responses([3], 4)
    for t, logp, _ in res.leaves:
        assert logp == pytest.approx(truth[tuple(t)], abs=1e-5)  # the more likely EOS ends it
    assert res.leaves[0][0] == []  # EOS at once (0.9 in all) is the most likely response


def test_likely_eos_still_gives_num_samples_distinct_candidates():
    """A chat model's short answers: two EOS ids with 0.9 of the mass, so the first leaves are
    reached at once and k_max = 2 leaves are reached before there are three distinct responses.
    The search goes on until it has num_samples (and not past its per-level budget)."""
    model = _PathModel(6, 0.5, 1, eos_ids=(0, 1), eos_mass=0.9)
    host = _FakeHost(model)
    params = ULTSParams(k_max=2, branching=3, belief_samples=300, alpha=1e-4)
    for prompt in ([3], [4], [5]):
        out = search(host, [prompt], 3, [5, 6, 7], SamplingParams(max_new_tokens=5), params)[0]
        seqs = [tuple(r.token_ids) for r in out.rows]
        assert sorted(r.row for r in out.rows) == [0, 1, 2] and len(set(seqs)) == 3
        assert out.stats["expansions"] <= 1 + 2 * 5


def test_an_exhausted_tree_returns_every_response_it_has():
    """Vocabulary {eos, eos, a}, one token: only two responses exist ("" and "a"). The search ends
    with both, once each, instead of counting "" twice; the model-side search says why it cannot give
    three."""
    model = _PathModel(3, 0.5, 0, eos_ids=(0, 1), eos_mass=0.5)
    beliefs = fit_level_beliefs(DirichletPrior(1e-4, 3), 1, 200)
    res = ults_search(model, [[1]], beliefs, 1, ULTSParams(branching=3, belief_samples=200), {0, 1},
                      min_leaves=3, seeds=[0])[0]
    assert sorted(tokens for tokens, _, _ in res.leaves) == [[], [2]]
    with pytest.raises(RuntimeError, match="only 2 distinct responses"):
        search(_FakeHost(model), [[1]], 3, [0, 1, 2], SamplingParams(max_new_tokens=1), ULTSParams(belief_samples=200))


class _TwinTokenHost(_FakeHost):
    """Tokens 3 and 4 spell the same text, as a byte piece or a split word can in a real tokenizer."""

    def decode(self, token_lists):
        return [" ".join(str(3 if t == 4 else t) for t in tokens) for tokens in token_lists]


def test_candidates_are_distinct_texts_and_the_most_likely_ones():
    """Two token sequences that spell one text are one response: the model-side search returns
    num_samples distinct texts, each by its most likely spelling, and (optimistic prior, no k_max
    cap) they are exactly the most likely texts, found by enumerating every response."""
    params = ULTSParams(k_max=None, branching=3, belief_samples=300, alpha=1e-4)
    for seed in range(3):
        model = _PathModel(5, 0.5, seed, eos_ids=(0,), eos_mass=0.2)
        host = _TwinTokenHost(model)
        by_text: dict[str, tuple[float, tuple[int, ...]]] = {}
        for tokens, logp in model.responses([6], 3).items():
            text = host.decode([list(tokens)])[0]
            by_text[text] = max(by_text.get(text, (-np.inf, ())), (logp, tokens))
        truth = sorted(by_text.items(), key=lambda kv: -kv[1][0])[:3]
        out = search(host, [[6]], 3, [1, 2, 3], SamplingParams(max_new_tokens=3), params)[0]
        assert [r.text for r in out.rows] == [text for text, _ in truth], seed
        assert [tuple(r.token_ids) for r in out.rows] == [tokens for _, (_, tokens) in truth], seed


def test_collect_softmax_is_per_prompt_and_greedy_first():
    """C of a prompt: its own rollouts, the first greedy (the authors' sample_llm_outputs.py), the
    others sampled with the prompt's seed; the same whether the prompt is collected alone or with
    others."""
    model = _PathModel(6, 0.3, 2, eos_ids=(0,), eos_mass=0.05)
    together, fed = collect_softmax(model, [[3], [4]], 10, 4, seeds=[7, 8], eos_ids={0})
    alone, fed_alone = collect_softmax(model, [[4]], 10, 4, seeds=[8], eos_ids={0})
    np.testing.assert_array_equal(together[1], alone[0])
    assert fed[1] == fed_alone[0]
    assert [c.shape for c in together] == [(10, 6), (10, 6)] and np.all(np.diff(together[0], axis=1) <= 0)
    # 10 vectors over 4 tokens: three rollouts of 4 steps; vector 3 * s is the greedy rollout's step s
    context = (3,)
    for step in range(4):
        probs = np.exp(model.logprobs(context))
        np.testing.assert_allclose(together[0][3 * step], -np.sort(-probs), rtol=1e-6)
        context += (int(probs.argmax()),)
    # the other rollouts are sampled: another seed gives another C
    other, _ = collect_softmax(model, [[3]], 10, 4, seeds=[9], eos_ids={0})
    assert not np.array_equal(other[0], together[0])


def test_ults_params_validate_selection_and_k_max():
    from pipeline.decoding.ults import ULTSParams
    from pipeline.errors import ConfigError

    assert ULTSParams(selection="boundary", k_max=None).k_max is None
    with pytest.raises(ConfigError, match="strategy.selection"):
        ULTSParams(selection="greedy")
    with pytest.raises(ConfigError, match="strategy.k_max"):
        ULTSParams(k_max=0)
