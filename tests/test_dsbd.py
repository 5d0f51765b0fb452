"""DSBD (pipeline.decoding.dsbd): the dynamic-width math (Eq. 2-7), Theorem 3.1 (output beams iid
p_beam) with a chi-square test, the whole decoder against the exact law of beam sampling on bigram
"models" (tests.bigram_models), at the length cap, under temperature / top-k / top-p warping and with
dynamic widths, negative controls that those tests reject (a biased drafter, p' not reset, a layer
filled without the residual, q not restricted to the accepted parents), and the model-side method
on tiny models."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

import pipeline.decoding.dsbd as dsbd
from pipeline.decoding.dsbd import (DecodeStats, DSBDParams, LayerVerdict, accepted_count_distribution,
                                    acceptance_chain, beam_sampling, dsbd_decode, dynamic_width, surviving_drafts,
                                    verify_layer)
from pipeline.decoding.dsbd import search as dsbd_search
from pipeline.decoding.sampling import SamplingParams, beam_distribution, inverse_cdf, residual_distribution
from tests.bigram_models import (DRAFT, TARGET, V, BigramDrafter, BigramTarget, HostState, chi_square_pvalue,
                                 exact_beam_sampling, final_beam_law, random_table)

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
# Two input beams, six tokens: twelve pairs, so that top-k 10 of the joint (Eq. 1) drops some.
PREFIX_6 = torch.log(torch.tensor([0.55, 0.45]))
P_NEXT_6 = random_table(6, seed=3)[:2]
Q_NEXT_6 = 0.3 * P_NEXT_6 + 0.7 * random_table(6, seed=4)[:2]
TRIALS = 8000
# The warpings T of Eq. 1: a temperature other than 1, and the DSBD paper's top-k 10 and top-p 0.8
# (section 4.1), alone and together.
WARPINGS = {"T0.7": SamplingParams(temperature=0.7), "top_k10": SamplingParams(top_k=10),
            "top_p0.8": SamplingParams(top_p=0.8), "paper": SamplingParams(temperature=0.7, top_k=10, top_p=0.8)}


def verify_layer_variant(*, reset: bool = True, fill_from_residual: bool = True):
    """verify_layer (Algorithm 1, lines 12-30) rewritten with a bug switched on, for negative
    controls: ``reset=False`` leaves p' at the residual after an acceptance (no line 18);
    ``fill_from_residual=False`` fills a failed layer wholly from p_beam (no line 26)."""

    def verify(p_beam, q_beam, candidates, width, uniforms):
        p_prime = p_beam
        accepted = []
        for pos, x in enumerate(candidates):
            if len(accepted) == width:
                break
            if uniforms() * float(q_beam[x]) < float(p_prime[x]):
                accepted.append(pos)
                p_prime = p_beam if reset else p_prime
            else:
                p_prime = residual_distribution(p_prime, q_beam)
        outputs = [candidates[pos] for pos in accepted]
        if len(accepted) == width:
            return LayerVerdict(accepted, outputs, True)
        if fill_from_residual:
            outputs.append(int(inverse_cdf(p_prime, torch.tensor(uniforms()))))
        while len(outputs) < width:
            outputs.append(int(inverse_cdf(p_beam, torch.tensor(uniforms()))))
        return LayerVerdict(accepted, outputs, False)

    return verify


def layer_distributions(prefix, p_next, q_next, sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """p_beam and q_beam (Eq. 1, warped by ``sampling``) of one layer over (input beam, token)."""
    return beam_distribution(prefix, p_next.log(), sampling), beam_distribution(prefix, q_next.log(), sampling)


def output_beams(p_beam, q_beam, draw_candidates, seed: int, draft_width: int = 3, width: int = 2,
                 verify=verify_layer) -> torch.Tensor:
    """Algorithm 1 on one layer TRIALS times: [TRIALS, width] flat indices of the output beams."""
    g = torch.Generator().manual_seed(seed)
    u = lambda: float(torch.rand((), generator=g))  # noqa: E731
    return torch.tensor([verify(p_beam, q_beam, draw_candidates(q_beam, draft_width, g), width, u).outputs
                         for _ in range(TRIALS)])


def iid_pvalues(beams: torch.Tensor, p_beam: torch.Tensor) -> list[float]:
    """Chi-square p-values: each output beam ~ p_beam, and the first two jointly ~ p_beam x p_beam."""
    p = p_beam.double().tolist()
    pvalues = [chi_square_pvalue(Counter((x,) for x in beams[:, i].tolist()), {(x,): px for x, px in enumerate(p)})
               for i in range(beams.shape[1])]
    pairs = Counter(tuple(pair) for pair in beams[:, :2].tolist())
    pvalues.append(chi_square_pvalue(pairs, {(a, b): p[a] * p[b] for a in range(len(p)) for b in range(len(p))}))
    return pvalues


def sampled_from_q(q_beam, n, g):
    return inverse_cdf(q_beam[None].expand(n, -1), torch.rand(n, generator=g)).tolist()


def test_theorem_3_1_output_beams_are_iid_p_beam():
    p_beam, q_beam = layer_distributions(PREFIX, P_NEXT, Q_NEXT, SamplingParams())
    assert min(iid_pvalues(output_beams(p_beam, q_beam, sampled_from_q, seed=0), p_beam)) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("warping", WARPINGS)
def test_theorem_3_1_under_warping(warping):
    """Twelve (beam, token) pairs, p_beam and q_beam warped: the output beams are iid the WARPED p_beam."""
    p_beam, q_beam = layer_distributions(PREFIX_6, P_NEXT_6, Q_NEXT_6, WARPINGS[warping])
    assert (p_beam == 0).any() or warping == "T0.7"  # the warping removed pairs from the support
    assert min(iid_pvalues(output_beams(p_beam, q_beam, sampled_from_q, seed=0), p_beam)) > 1e-3


def test_theorem_3_1_test_catches_drafts_not_sampled_from_q():
    """A drafter that proposes its top-scoring beams instead of sampling them from q_beam."""

    def top_beams(q_beam, n, g):
        return torch.topk(q_beam, n).indices.tolist()

    p_beam, q_beam = layer_distributions(PREFIX, P_NEXT, Q_NEXT, SamplingParams())
    assert min(iid_pvalues(output_beams(p_beam, q_beam, top_beams, seed=0), p_beam)) < 1e-6


def test_verify_layer_variant_without_bugs_is_verify_layer():
    """The negative controls below differ from the real verification in their bug only."""
    p_beam, q_beam = layer_distributions(PREFIX_6, P_NEXT_6, Q_NEXT_6, WARPINGS["paper"])
    for seed in range(300):
        verdicts = []
        for verify in (verify_layer, verify_layer_variant()):
            g = torch.Generator().manual_seed(seed)
            verdicts.append(verify(p_beam, q_beam, sampled_from_q(q_beam, 4, g), 2,
                                   lambda: float(torch.rand((), generator=g))))
        assert verdicts[0] == verdicts[1]


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["no_p_prime_reset", "fill_from_p_beam"])
def test_theorem_3_1_test_catches_verification_bugs(bug):
    """Negative controls under the paper's warping: (a) p' not reset to p_beam after an acceptance,
    (b) a failed layer filled from p_beam alone (no beam from the residual p')."""
    variant = verify_layer_variant(reset=bug != "no_p_prime_reset", fill_from_residual=bug != "fill_from_p_beam")
    p_beam, q_beam = layer_distributions(PREFIX_6, P_NEXT_6, Q_NEXT_6, WARPINGS["paper"])
    assert min(iid_pvalues(output_beams(p_beam, q_beam, sampled_from_q, seed=0, verify=variant), p_beam)) < 1e-6


# -- the whole decoder on bigram models, against exact beam sampling -----------------------------


def dsbd_counts(target: torch.Tensor, drafter, params: DSBDParams, sampling: SamplingParams, runs: int,
                prompt: tuple = (0,), stats: DecodeStats | None = None, fixed_width: int | None = 2) -> Counter:
    """How often DSBD answers each sequence over seeds 0..runs-1."""
    return Counter(tuple(dsbd_decode(BigramTarget(target), drafter, list(prompt), params, sampling, seed, stats=stats,
                                     fixed_width=fixed_width)) for seed in range(runs))


def decoder_pvalue(drafter, runs: int = 2500, prompt: tuple = (0,), stats: DecodeStats | None = None) -> float:
    params = DSBDParams(draft_width=3, num_draft_layers=2)
    return chi_square_pvalue(dsbd_counts(TARGET, drafter, params, SAMPLING, runs, prompt, stats),
                             exact_beam_sampling(width=2, steps=3, start=prompt[-1]))


def test_dsbd_output_is_distributed_as_beam_sampling():
    """Several draft layers per iteration, rejected parents' children removed (q restricted to the
    accepted parents), extra layers: the final beam is distributed as under beam sampling."""
    assert decoder_pvalue(BigramDrafter()) > 1e-3


def test_beam_sampling_decoder_matches_its_enumeration():
    runs = 2500
    counts = Counter(tuple(beam_sampling(BigramTarget(), [0], 2, SAMPLING, seed)) for seed in range(runs))
    assert chi_square_pvalue(counts, exact_beam_sampling(width=2, steps=3)) > 1e-3


@pytest.mark.parametrize("draft,max_new_tokens", [("target", 2), ("bigram", 3)])
def test_dsbd_at_the_length_cap_is_distributed_as_beam_sampling(draft, max_new_tokens):
    """gamma = num_draft_layers = max_new_tokens (before draft_depth): every iteration that passes its
    draft layers reaches the cap, and Algorithm 1's extra layer (lines 31-33) must not carry the beams
    past it. With the draft equal to the target every layer passes. Beam sampling ranks beams of
    exactly max_new_tokens tokens; so must DSBD, and each run generates exactly that many positions."""
    runs = 3000
    sampling = SamplingParams(max_new_tokens=max_new_tokens)
    params = DSBDParams(draft_width=3, num_draft_layers=max_new_tokens)
    stats = DecodeStats()
    counts = dsbd_counts(TARGET, BigramDrafter(TARGET if draft == "target" else DRAFT), params, sampling, runs,
                         stats=stats)
    assert chi_square_pvalue(counts, exact_beam_sampling(2, max_new_tokens, sampling=sampling)) > 1e-3
    assert stats.steps == runs * max_new_tokens


# Six tokens, two beams: p_beam has twelve (beam, token) pairs, so top-k 10 of the joint drops some.
# A draft that overlaps the target partly and W_S = 5 > W_L = 2: rejections, residuals, drafts of
# rejected parents removed (line 10) and extra layers all happen.
TARGET_6 = random_table(6, seed=1)
DRAFT_6 = 0.3 * TARGET_6 + 0.7 * random_table(6, seed=2)
WARPED_PARAMS = DSBDParams(draft_width=5, num_draft_layers=2)


def warped_pvalue(warping: str, runs: int = 3000) -> float:
    sampling = replace(WARPINGS[warping], max_new_tokens=3)
    counts = dsbd_counts(TARGET_6, BigramDrafter(DRAFT_6), WARPED_PARAMS, sampling, runs)
    return chi_square_pvalue(counts, exact_beam_sampling(2, 3, table=TARGET_6, sampling=sampling))


@pytest.mark.slow
@pytest.mark.parametrize("warping", WARPINGS)
def test_dsbd_under_warping_is_distributed_as_beam_sampling(warping):
    """Temperature 0.7, top-k 10, top-p 0.8 and all three: p_beam and q_beam are warped joints
    (Eq. 1); the answer is distributed as warped beam sampling's."""
    assert warped_pvalue(warping) > 1e-3


def surviving_drafts_unrestricted(layer, accepted, vocab, device):
    """surviving_drafts (line 10) with the bug of verifying the survivors against the unconditional
    q_beam (restricted to the accepted parents but not renormalised)."""
    survivors, candidates, _ = surviving_drafts(layer, accepted, vocab, device)
    return survivors, candidates, layer.q_beam.to(device).reshape(-1, vocab)[accepted].reshape(-1).float()


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["fill_from_p_beam", "q_not_restricted"])
def test_the_decoder_test_catches_verification_bugs(bug, monkeypatch):
    """Negative controls, paper warping: (b) a failed layer filled from p_beam alone, (c) survivors
    verified against q_beam not restricted to the accepted parents. (Not resetting p' after an
    acceptance (a) barely moves the lowest-perplexity beam: the layer test above catches it.)"""
    if bug == "fill_from_p_beam":
        monkeypatch.setattr(dsbd, "verify_layer", verify_layer_variant(fill_from_residual=False))
    else:
        monkeypatch.setattr(dsbd, "surviving_drafts", surviving_drafts_unrestricted)
    assert warped_pvalue("paper") < 1e-6


# Dynamic width (Eq. 2-7). Four tokens, W_S = 3, gamma = 2, three positions, thresholds t such that
# the first layer's width is W_S and later widths depend on the beams.
TARGET_4 = random_table(4, seed=3)
DRAFT_4 = 0.6 * TARGET_4 + 0.4 * random_table(4, seed=103)
DYNAMIC = {"T1": (SamplingParams(max_new_tokens=3), 0.5), "paper": (replace(WARPINGS["paper"], max_new_tokens=3), 0.7)}


def dynamic_width_law(params: DSBDParams, sampling: SamplingParams, start: int = 0) -> tuple[dict, Counter]:
    """The exact law of DSBD's answer with dynamic widths, for three positions, gamma = 2 and a root
    width W_1 = W_S, on the bigram models (TARGET_4 drafted by BigramDrafter(DRAFT_4)).

    Layer 1's W_S output beams B_1 are iid p_beam (Theorem 3.1). The layer passes only if all W_S
    drafts are accepted, each at the first try: P(pass, B_1) = prod min(p, q)(x_i). Then layer 2
    verifies the same forest's drafts (all parents accepted; q_beam weights B_1 by the draft's
    likelihood); else, the next iteration drafts from B_1 weighted by the target's likelihood
    (gamma = 1: one position is kept for the extra layer). Either way that layer's width W_2 follows
    Eq. 6 from its p_beam and q_beam, its W_2 beams are iid p_beam, and so are the W_2 beams of the
    third position (line 33, or a gamma = 0 iteration). So the law is the sum over B_1 and the two
    branches of beam sampling from B_1 at widths (W_2, W_2) (bigram_models.final_beam_law).
    Returns the law and the probability of each W_2."""
    log_t, log_d = TARGET_4.log(), DRAFT_4.log()
    p = beam_distribution(torch.zeros(1), log_t[start][None], sampling)
    q = beam_distribution(torch.zeros(1), log_d[start][None], sampling)

    def width(p_beam, q_beam) -> int:
        return dynamic_width(acceptance_chain(p_beam, q_beam, params.draft_width), params.acceptance_threshold,
                             params.min_width)

    assert width(p, q) == params.draft_width
    law, widths, memo = Counter(), Counter(), {}
    for b1 in itertools.product(range(len(p)), repeat=params.draft_width):
        both = math.prod(float(p[x]) for x in b1)
        passed = math.prod(float(torch.minimum(p, q)[x]) for x in b1)
        if both == 0:
            continue
        beams = tuple(((x,), 0.0 + float(log_t[start, x])) for x in b1)
        p_beam = beam_distribution(torch.tensor([logp for _, logp in beams]), log_t[list(b1)], sampling)
        q_same_forest = beam_distribution(torch.tensor([float(log_d[start, x]) for x in b1]), log_d[list(b1)], sampling)
        q_next_iteration = beam_distribution(torch.tensor([logp for _, logp in beams]), log_d[list(b1)], sampling)
        for weight, q_beam in ((passed, q_same_forest), (both - passed, q_next_iteration)):
            w2 = width(p_beam, q_beam)
            widths[w2] += weight
            for seq, prob in final_beam_law(beams, [w2, w2], TARGET_4, sampling, start, memo).items():
                law[seq] += weight * prob
    return law, widths


@pytest.mark.slow
@pytest.mark.parametrize("case", DYNAMIC)
def test_dsbd_with_dynamic_width_follows_its_exact_law(case):
    """Eq. 6 sets each layer's width from its p_beam and q_beam; the answer follows the law of beam
    sampling at those widths (dynamic_width_law), at temperature 1 and under the paper's warping."""
    sampling, threshold = DYNAMIC[case]
    params = DSBDParams(draft_width=3, num_draft_layers=2, acceptance_threshold=threshold)
    law, widths = dynamic_width_law(params, sampling)
    assert sum(w > 0.05 for w in widths.values()) >= 2  # the width depends on the beams
    counts = dsbd_counts(TARGET_4, BigramDrafter(DRAFT_4), params, sampling, runs=2500, fixed_width=None)
    assert chi_square_pvalue(counts, law) > 1e-3
    for fixed in (2, 3):  # and the test tells the dynamic widths from fixed ones
        assert chi_square_pvalue(counts, final_beam_law((((), 0.0),), [3, fixed, fixed], TARGET_4, sampling)) < 1e-6


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

    drafter, stats = aded_layer_drafter(), DecodeStats()
    counts = Counter(tuple(speculative_decode(BigramTarget(), drafter, [1, 2, 0], 2, SAMPLING, seed, stats=stats))
                     for seed in range(2000))
    assert chi_square_pvalue(counts, exact_beam_sampling(width=1, steps=3)) > 1e-3
    assert stats.steps > stats.target_forwards  # some drafts were accepted


class BigramSearchHost(HostState):
    """A DSBDHost over the bigram target with no draft model, so that ADED drafts."""

    eos_ids: set[int] = set()
    vocab_size = V
    drafter = None

    def forest_target(self):
        return BigramTarget()

    def load_trigram(self, path, top_t):
        from pipeline.decoding.trigram import TrigramMatrix

        return TrigramMatrix(top_t)


def test_dsbd_aded_candidates_do_not_depend_on_batch_mates():
    """Issue 12, item 9: the ADED drafter's tri-gram matrix starts from the same state for every
    prompt, so a prompt's candidates (and what they cost) are the same alone as in a batch, whatever
    the matrix learned from the prompts before it."""
    host = BigramSearchHost()
    prompts = [[2, 1, 0, 0, 1, 2], [0, 1, 2, 2], [1, 0, 0]]
    sampling, params = SamplingParams(max_new_tokens=8), DSBDParams(draft_width=2, num_draft_layers=2)
    seeds = list(range(10, 10 + 2 * len(prompts)))
    batch = dsbd_search(host, prompts, 2, seeds, sampling, params)
    assert sum(o.stats["draft_layers_accepted"] for o in batch) > 0  # the drafts matter
    for i, prompt in enumerate(prompts):
        alone = dsbd_search(host, [prompt], 2, seeds[2 * i:2 * i + 2], sampling, params)[0]
        assert [r.token_ids for r in alone.rows] == [r.token_ids for r in batch[i].rows]
        assert (alone.generated_tokens, alone.stats) == (batch[i].generated_tokens, batch[i].stats)


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
    again = dsbd_search(host, prompts, 1, [3, 4], sampling, params)  # the matrix is reset per prompt
    assert [[r.token_ids for r in o.rows] for o in again] == [[r.token_ids for r in o.rows] for o in out]


def test_dsbd_decode_stats_count_layers():
    stats = DecodeStats()
    tokens = dsbd_decode(BigramTarget(), BigramDrafter(TARGET), [0], DSBDParams(draft_width=3, num_draft_layers=2),
                         SamplingParams(max_new_tokens=9), 0, stats=stats)
    assert len(tokens) == 9
    # The draft IS the target here: every layer passes, each iteration adds gamma + 1 steps.
    assert stats.iterations == 3 and stats.draft_layers_accepted == 6


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
    from pipeline.preflight import MODEL_FILES
    from pipeline.strategies import lookup

    prompt = engine.tokenizer("Write a review of the lamp.").input_ids
    path = str(tmp_path / "m.npz")
    save_trigram(TrigramMatrix.from_sequences([prompt + prompt]), path)
    params = DSBDParams(draft_width=2, num_draft_layers=2, trigram=path)
    check = lookup("dsbd").check_models
    check(params, None, MODEL_FILES)
    host = HFSearchHost(engine)
    out = dsbd_search(host, [prompt], 1, [3], SamplingParams(max_new_tokens=4, ignore_eos=True), params)
    assert len(out[0].rows[0].token_ids) == 4
    drafter = host.remember(("dsbd-aded-drafter", path), lambda: None)
    assert len(drafter.initial) == len(load_trigram(path)) > 0
    (tmp_path / "bad.npz").write_bytes(b"no")
    with pytest.raises(ConfigError, match="strategy.trigram"):
        check(DSBDParams(trigram=str(tmp_path / "bad.npz")), None, MODEL_FILES)


def test_dsbd_benchmark_runs_the_aded_rows_on_prompt_file_prompts(tiny_models, tmp_path):
    """benchmarks.dsbd --aded --prompts: speculative decoding and DSBD with ADED drafts next to
    the draft model's, each row saying which drafter ran."""
    import json

    from benchmarks import dsbd as bench
    from tests.conftest import write_jsonl

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Describe how the lamp works."}])
    out = tmp_path / "dsbd.json"
    assert bench.main(["--models", str(tiny_models["generator"].parent), "--prompts", str(prompts),
                       "--num-prompts", "1", "--max-new-tokens", "5", "--repeats", "1", "--aded", "--no-ray",
                       "--json", str(out), "--plot", str(tmp_path / "dsbd.png")]) == 0
    results = json.loads(out.read_text())["results"]
    aded = {n: r for n, r in results.items() if r["drafter"] == "aded"}
    assert set(aded) == {"speculative_aded", "dsbd_aded_ws2_g3_t0.9", "dsbd_aded_ws3_g3_t0.9"}
    assert results["speculative"]["drafter"] == "draft model"
    assert all(r["tokens_per_s"] > 0 and r["perplexity"] > 1 for r in results.values())
