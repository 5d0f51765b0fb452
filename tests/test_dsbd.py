"""DSBD (pipeline.decoding.dsbd): the dynamic-width math (Eq. 2-7), Theorem 3.1 (output beams iid
p_beam) with a chi-square test that also catches a biased drafter, the whole decoder against the
exact beam-sampling distribution on bigram "models", and the model-side method on tiny models."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy.stats import chisquare

from pipeline.decoding.dsbd import (Beam, DecodeStats, DSBDParams, accepted_count_distribution, acceptance_chain,
                                    beam_sampling, dsbd_decode, dynamic_width, verify_layer)
from pipeline.decoding.dsbd import search as dsbd_search
from pipeline.decoding.protocols import DraftLayer
from pipeline.decoding.sampling import SamplingParams, beam_distribution, inverse_cdf

SAMPLING = SamplingParams(max_new_tokens=3)


# -- Eq. 2-7 ----------------------------------------------------------------------------------


def test_accepted_count_distribution_matches_simulated_verification():
    g = torch.Generator().manual_seed(0)
    p = torch.rand(6, generator=g).softmax(0)
    q = (torch.rand(6, generator=g) * 3).softmax(0)
    m = 4
    exact = accepted_count_distribution(acceptance_chain(p, q, m))
    counts = torch.zeros(m + 1)
    trials = 4000
    for _ in range(trials):
        candidates = inverse_cdf(q[None].expand(m, -1), torch.rand(m, generator=g)).tolist()
        verdict = verify_layer(p, q, candidates, width=m + 1, uniforms=lambda: float(torch.rand((), generator=g)))
        counts[len(verdict.accepted)] += 1
    assert abs(float(exact.sum()) - 1) < 1e-6
    assert chisquare(counts.numpy(), (exact.float() / exact.sum() * trials).numpy()).pvalue > 1e-3


def test_dynamic_width_rule():
    assert dynamic_width(torch.ones(4), threshold=0.9, min_width=1) == 4  # every beam surely accepted
    assert dynamic_width(torch.zeros(4), threshold=0.9, min_width=2) == 2  # none: W_min
    # alpha = 0.5 each, 2 beams: P(0) = 1/4, P(1) = 1/2, P(2) = 1/4 -> P(>=1) = 3/4, P(>=2) = 1/4.
    alphas = torch.tensor([0.5, 0.5])
    torch.testing.assert_close(accepted_count_distribution(alphas), torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64))
    assert dynamic_width(alphas, threshold=0.7, min_width=1) == 1
    assert dynamic_width(alphas, threshold=0.2, min_width=1) == 2


def test_acceptance_chain_first_alpha_is_overlap():
    p, q = torch.tensor([0.7, 0.3, 0.0]), torch.tensor([0.2, 0.3, 0.5])
    alphas = acceptance_chain(p, q, 2)
    assert math.isclose(float(alphas[0]), 0.5, abs_tol=1e-6)  # sum min(p, q)
    assert math.isclose(float(alphas[1]), 0.2, abs_tol=1e-6)  # residual (1, 0, 0) against q


# -- Theorem 3.1 ------------------------------------------------------------------------------

# Two input beams, three tokens: p_beam and q_beam over the six (beam, token) pairs.
PREFIX = torch.log(torch.tensor([0.6, 0.4]))
P_NEXT = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
Q_NEXT = torch.tensor([[0.2, 0.6, 0.2], [0.5, 0.3, 0.2]])
TRIALS = 8000


def output_beams(draw_candidates, seed: int, draft_width: int = 3, width: int = 2) -> torch.Tensor:
    """Algorithm 1 on one layer TRIALS times: [TRIALS, width] flat indices of the output beams."""
    p_beam = beam_distribution(PREFIX, P_NEXT.log(), SamplingParams())
    q_beam = beam_distribution(PREFIX, Q_NEXT.log(), SamplingParams())
    g = torch.Generator().manual_seed(seed)
    u = lambda: float(torch.rand((), generator=g))  # noqa: E731
    out = []
    for _ in range(TRIALS):
        verdict = verify_layer(p_beam, q_beam, draw_candidates(q_beam, draft_width, g), width, u)
        out.append(verdict.outputs)
    return torch.tensor(out)


def iid_pvalues(beams: torch.Tensor) -> list[float]:
    p_beam = beam_distribution(PREFIX, P_NEXT.log(), SamplingParams()).double()
    p_beam = p_beam / p_beam.sum()
    cells = len(p_beam)
    pvalues = []
    for i in range(beams.shape[1]):  # each output beam ~ p_beam
        observed = torch.bincount(beams[:, i], minlength=cells).double()
        pvalues.append(chisquare(observed.numpy(), (p_beam * TRIALS).numpy()).pvalue)
    joint = (p_beam[:, None] * p_beam[None]).reshape(-1)  # beams 1 and 2 independent
    observed = torch.bincount(beams[:, 0] * cells + beams[:, 1], minlength=cells * cells).double()
    pvalues.append(chisquare(observed.numpy(), (joint / joint.sum() * TRIALS).numpy()).pvalue)
    return pvalues


def sampled_from_q(q_beam, n, g):
    return inverse_cdf(q_beam[None].expand(n, -1), torch.rand(n, generator=g)).tolist()


def test_theorem_3_1_output_beams_are_iid_p_beam():
    assert min(iid_pvalues(output_beams(sampled_from_q, seed=0))) > 1e-3


def test_theorem_3_1_test_catches_drafts_not_sampled_from_q():
    """A drafter that proposes its top-scoring beams instead of sampling them from q_beam."""

    def top_beams(q_beam, n, g):
        return torch.topk(q_beam, n).indices.tolist()

    assert min(iid_pvalues(output_beams(top_beams, seed=0))) < 1e-6


# -- the whole decoder on bigram models, against exact beam sampling -----------------------------

V = 3
TARGET = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.3, 0.3, 0.4]])
DRAFT = torch.tensor([[0.4, 0.4, 0.2], [0.3, 0.4, 0.3], [0.2, 0.2, 0.6]])


class BigramTarget:
    """ForestTarget over a bigram table: a node's next-token distribution depends on its token only."""

    forward_passes = 0

    def open(self, prompt):
        pass

    def verify(self, trees):
        n = max(len(t.tokens) for t in trees)
        out = torch.zeros((len(trees), n, V))
        for b, t in enumerate(trees):
            out[b, :len(t.tokens)] = TARGET[t.tokens].log()
        return out

    def commit(self, sources):
        pass


class BigramDrafter:
    def __init__(self, table=DRAFT):
        self.table = table

    def draft(self, contexts, prefix_logp, width, depth, sampling, seed):
        g = torch.Generator().manual_seed(seed)
        last = torch.tensor([c[-1] for c in contexts])
        scores = torch.tensor(prefix_logp)
        layers = []
        for _ in range(depth):
            logq = self.table[last].log()
            q_beam = beam_distribution(scores, logq, sampling)
            flat = inverse_cdf(q_beam[None].expand(width, -1), torch.rand(width, generator=g))
            parents, tokens = flat // V, flat % V
            layers.append(DraftLayer(parents.tolist(), tokens.tolist(), q_beam))
            scores, last = scores[parents] + logq[parents, tokens], tokens
        return layers


def exact_beam_sampling(width: int, steps: int, start: int = 0) -> dict[tuple, float]:
    """Distribution of the lowest-perplexity final beam of beam sampling, by enumeration."""
    out: dict[tuple, float] = {}

    def walk(beams: list[Beam], prob: float, step: int):
        if step == steps:
            best = max(beams, key=lambda b: b.logp).tokens
            out[tuple(best)] = out.get(tuple(best), 0.0) + prob
            return
        last = [b.tokens[-1] if b.tokens else start for b in beams]
        p = beam_distribution(torch.tensor([b.logp for b in beams]), TARGET[last].log(), SAMPLING).tolist()
        for picks in itertools.product(range(len(p)), repeat=width):
            weight = math.prod(p[x] for x in picks)
            if weight == 0:
                continue
            new = [Beam(beams[x // V].tokens + [x % V], beams[x // V].logp + math.log(TARGET[last[x // V], x % V]))
                   for x in picks]
            walk(new, prob * weight, step + 1)

    walk([Beam([], 0.0)], 1.0, 0)
    return out


def decoder_pvalue(drafter, runs: int = 2500, prompt: tuple = (0,), stats: DecodeStats | None = None) -> float:
    exact = exact_beam_sampling(width=2, steps=3, start=prompt[-1])
    keys = sorted(exact)
    counts = dict.fromkeys(keys, 0)
    params = DSBDParams(draft_width=3, num_draft_layers=2)
    for seed in range(runs):
        counts[tuple(dsbd_decode(BigramTarget(), drafter, list(prompt), params, SAMPLING, seed, stats=stats,
                                 fixed_width=2))] += 1
    expected = torch.tensor([exact[k] for k in keys], dtype=torch.float64)
    return chisquare([counts[k] for k in keys], (expected / expected.sum() * runs).numpy()).pvalue


def test_dsbd_output_is_distributed_as_beam_sampling():
    """Several draft layers per iteration, rejected parents' children removed (q restricted to the
    accepted parents), extra layers: the final beam is distributed as under beam sampling."""
    assert decoder_pvalue(BigramDrafter()) > 1e-3


def test_beam_sampling_decoder_matches_its_enumeration():
    exact = exact_beam_sampling(width=2, steps=3)
    keys = sorted(exact)
    counts = dict.fromkeys(keys, 0)
    runs = 2500
    for seed in range(runs):
        counts[tuple(beam_sampling(BigramTarget(), [0], 2, SAMPLING, seed))] += 1
    expected = torch.tensor([exact[k] for k in keys], dtype=torch.float64)
    assert chisquare([counts[k] for k in keys], (expected / expected.sum() * runs).numpy()).pvalue > 1e-3


# -- on tiny models: the model-side method ----------------------------------------------------------


@pytest.fixture(scope="module")
def engine_with_draft(tiny_models):
    from pipeline.engines.draft import HFDrafter
    from pipeline.engines.hf import HFEngine

    engine = HFEngine.from_pretrained(str(tiny_models["generator"]))
    engine.drafter = HFDrafter.from_pretrained(str(tiny_models["draft"]))
    return engine


@pytest.mark.parametrize("memory_mode", [False, True])
def test_dsbd_search_on_tiny_models(engine_with_draft, memory_mode):
    engine = engine_with_draft
    prompts = [engine.tokenizer(t).input_ids for t in ("Write a review of the lamp.", "Describe how")]
    sampling = SamplingParams(max_new_tokens=12, ignore_eos=True)
    params = DSBDParams(draft_width=3, num_draft_layers=2, memory_mode=memory_mode)
    seeds = [11, 12, 13, 14]
    out = dsbd_search(engine.search_host, prompts, 2, seeds, sampling, params)
    assert [sorted(r.row for r in o.rows) for o in out] == [[0, 1], [2, 3]]
    assert all(len(r.token_ids) == 12 for o in out for r in o.rows)
    stats = out[0].stats
    # Forest verification: fewer target passes than generated positions.
    assert 0 < stats["target_forwards"] < stats["steps"]
    again = dsbd_search(engine.search_host, prompts, 2, seeds, sampling, params)
    assert [[r.token_ids for r in o.rows] for o in again] == [[r.token_ids for r in o.rows] for o in out]


# -- ADED as the drafter (no draft model) ------------------------------------------------------


def aded_layer_drafter(**kw):
    from pipeline.decoding.aded import ADEDDrafter, ADEDLayerDrafter
    from pipeline.decoding.trigram import TrigramMatrix

    matrix = TrigramMatrix.from_sequences([[2, 1, 0, 0, 1, 2, 2, 0, 1, 1, 0]])
    return ADEDLayerDrafter(ADEDDrafter(matrix, iterations=12, **kw), vocab_size=V)


class MislabelledADED:
    """ADED's deterministic drafts, but reported as drawn from a uniform q_beam: must be caught."""

    def __init__(self):
        self.inner = aded_layer_drafter()

    def draft(self, *args):
        layers = self.inner.draft(*args)
        for layer in layers:
            layer.q_beam = torch.full_like(layer.q_beam, 1 / layer.q_beam.numel())
        return layers


def test_aded_layer_drafter_is_one_hot_follows_the_matrix_and_learns():
    drafter = aded_layer_drafter()
    layers = drafter.draft([[2, 2, 1], [1, 2, 1]], [-1.0, -0.5], 3, 3, SAMPLING, 0)
    assert len(layers) == 3 and all(len(layer.tokens) == 3 and len(set(layer.tokens)) == 1 for layer in layers)
    assert layers[0].parents == [1, 1, 1] and all(layer.parents == [0, 0, 0] for layer in layers[1:])
    assert [layer.q_beam.numel() for layer in layers] == [2 * V, 3 * V, 3 * V]
    assert all(layer.q_beam.sum() == 1 and layer.q_beam.max() == 1 for layer in layers)
    assert layers[0].q_beam[1 * V + layers[0].tokens[0]] == 1
    # (2, 1) -> 0 is the matrix's only continuation; the chosen context (weight -0.5) was observed.
    assert layers[0].tokens[0] == 0
    matrix = drafter.drafter.matrix
    assert matrix.probability(1, 2, 1) > 0
    drafter.draft([[1, 2, 1, 2, 2]], [0.0], 1, 2, SAMPLING, 1)  # extends the last context: the new tri-grams
    assert matrix.probability(2, 1, 2) > 0 and matrix.probability(1, 2, 2) > 0
    drafter.reset()
    assert matrix is not drafter.drafter.matrix and drafter.drafter.matrix.probability(2, 1, 2) == 0


def test_dsbd_with_the_aded_drafter_is_distributed_as_beam_sampling():
    """One-hot q_beam from ADED's deterministic drafts keeps Theorem 3.1: the final beam is
    distributed as under beam sampling, with drafts accepted along the way; the tri-gram matrix
    adapts across the runs (no reset)."""
    stats = DecodeStats()
    drafter = aded_layer_drafter()
    before = len(drafter.drafter.matrix)
    assert decoder_pvalue(drafter, runs=2000, prompt=(2, 1, 0), stats=stats) > 1e-3
    assert stats.draft_layers_accepted > 0 and len(drafter.drafter.matrix) > before


def test_the_distribution_test_catches_aded_drafts_with_a_wrong_q():
    assert decoder_pvalue(MislabelledADED(), runs=2000, prompt=(2, 1, 0)) < 1e-6


def test_speculative_decode_with_the_aded_drafter_is_distributed_as_multinomial_sampling():
    from pipeline.decoding.speculative import speculative_decode

    exact = exact_beam_sampling(width=1, steps=3)
    keys = sorted(exact)
    counts = dict.fromkeys(keys, 0)
    runs = 2000
    drafter, stats = aded_layer_drafter(), DecodeStats()
    for seed in range(runs):
        counts[tuple(speculative_decode(BigramTarget(), drafter, [1, 2, 0], 2, SAMPLING, seed, stats=stats))] += 1
    expected = torch.tensor([exact[k] for k in keys], dtype=torch.float64)
    assert chisquare([counts[k] for k in keys], (expected / expected.sum() * runs).numpy()).pvalue > 1e-3
    assert stats.steps > stats.target_forwards  # some drafts were accepted


def test_dsbd_without_a_draft_model_drafts_with_aded(engine):
    sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompts = [engine.tokenizer(t).input_ids for t in ("Write a review of the lamp.", "Describe how")]
    params = DSBDParams(draft_width=2, num_draft_layers=2)
    from pipeline.decoding.aded import ADEDLayerDrafter
    from pipeline.engines.adapters import HFSearchHost

    host = HFSearchHost(engine)  # fresh per-engine state
    assert host.drafter is None
    out = dsbd_search(host, prompts, 1, [3, 4], sampling, params)
    drafter = host.remember(("dsbd-aded-drafter", ""), lambda: None)  # the engine keeps the one it made
    assert isinstance(drafter, ADEDLayerDrafter) and len(drafter.drafter.matrix) > 0
    assert [sorted(r.row for r in o.rows) for o in out] == [[0], [1]]
    assert all(len(r.token_ids) == 6 for o in out for r in o.rows)
    again = dsbd_search(host, prompts, 1, [3, 4], sampling, params)  # the matrix is reset per batch
    assert [[r.token_ids for r in o.rows] for o in again] == [[r.token_ids for r in o.rows] for o in out]


def test_dsbd_decode_stats_count_layers():
    stats = DecodeStats()
    tokens = dsbd_decode(BigramTarget(), BigramDrafter(TARGET), [0], DSBDParams(draft_width=3, num_draft_layers=2),
                         SamplingParams(max_new_tokens=9), 0, stats=stats)
    assert len(tokens) == 9
    # The draft IS the target here: every layer passes, each iteration adds gamma + 1 steps.
    assert stats.iterations == 3 and stats.draft_layers_accepted == 6


def test_speculative_decode_is_distributed_as_multinomial_sampling():
    from pipeline.decoding.speculative import speculative_decode

    exact = exact_beam_sampling(width=1, steps=3)  # width 1: multinomial sampling
    keys = sorted(exact)
    counts = dict.fromkeys(keys, 0)
    runs = 2500
    for seed in range(runs):
        counts[tuple(speculative_decode(BigramTarget(), BigramDrafter(), [0], 2, SAMPLING, seed))] += 1
    expected = torch.tensor([exact[k] for k in keys], dtype=torch.float64)
    assert chisquare([counts[k] for k in keys], (expected / expected.sum() * runs).numpy()).pvalue > 1e-3


def test_drafter_resumes_from_its_last_forest(tiny_models):
    """Contexts that extend the last call's rows reuse its KV state: same q_beam as a fresh prefill."""
    from pipeline.engines.draft import HFDrafter

    reuse = HFDrafter.from_pretrained(str(tiny_models["draft"]))
    fresh = HFDrafter(reuse.model, reuse_cache=False)
    sampling = SamplingParams()
    contexts = [[1, 40, 41, 42], [1, 50]]
    first = reuse.draft(contexts, [0.0, -1.0], 3, 2, sampling, 7)
    # Next contexts: a layer-1 node plus one new token; a layer-2 node (not fed yet) plus one.
    node1 = contexts[first[0].parents[0]] + [first[0].tokens[0]]
    node2 = contexts[first[0].parents[first[1].parents[0]]] + [first[0].tokens[first[1].parents[0]],
                                                               first[1].tokens[0]]
    for nxt in ([node1 + [60], node1 + [61]], [node2 + [70], node2 + [71]]):
        before = reuse.forward_passes
        got = reuse.draft(nxt, [0.0, -0.5], 3, 2, sampling, 8)
        assert reuse.forward_passes - before == 2  # resumed: no prefill
        want = fresh.draft(nxt, [0.0, -0.5], 3, 2, sampling, 8)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.q_beam, b.q_beam, atol=1e-5, rtol=0)
        reuse.draft(contexts, [0.0, -1.0], 3, 2, sampling, 7)  # back to the first forest


def test_dsbd_aded_drafter_starts_from_strategy_trigram(engine, tmp_path):
    from pipeline.config import ConfigError
    from pipeline.decoding.trigram import TrigramMatrix
    from pipeline.engines.adapters import HFSearchHost
    from pipeline.engines.trigram import load_trigram, save_trigram
    from pipeline.methods import method

    prompt = engine.tokenizer("Write a review of the lamp.").input_ids
    path = str(tmp_path / "m.npz")
    save_trigram(TrigramMatrix.from_sequences([prompt + prompt]), path)
    params = DSBDParams(draft_width=2, num_draft_layers=2, trigram=path)
    check = method("dsbd").check_models
    check(params, None)
    host = HFSearchHost(engine)
    out = dsbd_search(host, [prompt], 1, [3], SamplingParams(max_new_tokens=4, ignore_eos=True), params)
    assert len(out[0].rows[0].token_ids) == 4
    drafter = host.remember(("dsbd-aded-drafter", path), lambda: None)
    assert len(drafter.initial) == len(load_trigram(path)) > 0
    (tmp_path / "bad.npz").write_bytes(b"no")
    with pytest.raises(ConfigError, match="strategy.trigram"):
        check(DSBDParams(trigram=str(tmp_path / "bad.npz")), None)
