"""Speculative sampling (Leviathan et al.): the emitted tokens follow the target exactly.

The "models" are bigram tables over a 4-token vocabulary, so the target's distribution over the
first two generated tokens is known in closed form and a chi-square test can check the sampler.
The whole decoder (speculative_decode) is checked the same way over a 12-token vocabulary, at
temperatures 1 and 0.7 and under top-k 10 / top-p 0.8 warping, with negative controls.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

import pipeline.decoding.speculative as speculative
from pipeline.decoding.sampling import SamplingParams, beam_distribution, inverse_cdf, residual_distribution
from pipeline.decoding.speculative import speculative_decode, speculative_sampling
from tests.bigram_models import BigramDrafter, BigramTarget, chi_square_pvalue, exact_beam_sampling, random_table

V = 4
GAMMA = 3
SAMPLES = 20000


TARGET = torch.tensor([[0.50, 0.20, 0.20, 0.10], [0.10, 0.60, 0.15, 0.15], [0.25, 0.25, 0.25, 0.25],
                       [0.05, 0.15, 0.30, 0.50]])
DRAFT = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.40, 0.20, 0.20, 0.20], [0.10, 0.10, 0.70, 0.10],
                      [0.30, 0.30, 0.20, 0.20]])


def first_two_tokens(step, context: int, g: torch.Generator) -> torch.Tensor:
    """Run speculative steps from ``context`` for SAMPLES rows until each emitted 2 tokens: [SAMPLES, 2]."""
    emitted = [[] for _ in range(SAMPLES)]
    last = torch.full((SAMPLES,), context)
    while any(len(e) < 2 for e in emitted):
        drafts, q = [], []
        prev = last
        for _ in range(GAMMA):
            q.append(DRAFT[prev])
            prev = inverse_cdf(DRAFT[prev], torch.rand(SAMPLES, generator=g))
            drafts.append(prev)
        draft_tokens = torch.stack(drafts, 1)  # [B, gamma]
        contexts = torch.cat([last[:, None], draft_tokens], 1)  # p after the context and after each draft
        n, nxt = step(TARGET[contexts], torch.stack(q, 1), draft_tokens, torch.rand((SAMPLES, GAMMA), generator=g),
                      torch.rand(SAMPLES, generator=g))
        for i, (k, t) in enumerate(zip(n.tolist(), nxt.tolist())):
            emitted[i].extend(draft_tokens[i, :k].tolist() + [t])
        last = torch.tensor([e[-1] for e in emitted])
    return torch.tensor([e[:2] for e in emitted])


def pair_pvalue(step, seed: int) -> float:
    pairs = first_two_tokens(step, context=0, g=torch.Generator().manual_seed(seed))
    observed = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).double()
    exact = (TARGET[0][:, None] * TARGET).reshape(-1).double()  # p(a | 0) p(b | a)
    return chisquare(observed.numpy(), (exact / exact.sum() * SAMPLES).numpy()).pvalue


def test_speculative_sampling_matches_the_target_distribution():
    assert pair_pvalue(speculative_sampling, seed=1) > 1e-3


def test_the_chi_square_test_catches_resampling_from_p_instead_of_the_residual():
    def biased(p, q, tokens, accept_u, resample_u):
        n, _ = speculative_sampling(p, q, tokens, accept_u, resample_u)
        return n, inverse_cdf(p[torch.arange(len(n)), n], resample_u)  # wrong: ignores the residual

    assert pair_pvalue(biased, seed=1) < 1e-6


def test_accept_all_gives_bonus_from_last_position_and_reject_uses_residual():
    p = torch.tensor([[[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]])
    q = torch.tensor([[[0.0, 1.0, 0.0, 0.0]]])
    n, nxt = speculative_sampling(p, q, torch.tensor([[1]]), torch.tensor([[0.99]]), torch.tensor([0.5]))
    assert n.tolist() == [1] and nxt.tolist() == [3]  # accepted (p = q), bonus from p_2
    q = torch.tensor([[[0.0, 0.5, 0.5, 0.0]]])
    p = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]])
    n, nxt = speculative_sampling(p, q, torch.tensor([[2]]), torch.tensor([[0.0]]), torch.tensor([0.9]))
    assert n.tolist() == [0] and nxt.tolist() == [0]  # p(2) = 0: rejected; residual is all on token 0
    torch.testing.assert_close(residual_distribution(p[0, 0], q[0, 0]), torch.tensor([1.0, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("u,expected", [(0.0, 1), (0.49, 1), (0.51, 3), (0.999, 3)])
def test_inverse_cdf_skips_zero_mass_tokens(u, expected):
    assert int(inverse_cdf(torch.tensor([0.0, 0.5, 0.0, 0.5]), torch.tensor(u))) == expected


# -- speculative decoding end to end, against the exact (warped) multinomial sampling --------------

# Twelve tokens, so that top-k 10 drops some; flat enough rows that top-p 0.8 keeps six or more.
TARGET_12 = random_table(12, seed=5, spread=0.5)
DRAFT_12 = 0.5 * TARGET_12 + 0.5 * random_table(12, seed=6, spread=0.5)
# Temperature 1 and 0.7, the DSBD paper's top-k 10 and top-p 0.8 (section 4.1), and all three.
WARPINGS = {"T1": SamplingParams(), "T0.7": SamplingParams(temperature=0.7), "top_k10": SamplingParams(top_k=10),
            "top_p0.8": SamplingParams(top_p=0.8), "paper": SamplingParams(temperature=0.7, top_k=10, top_p=0.8)}


class UnwarpedQDrafter(BigramDrafter):
    """Drafts from the warped q like BigramDrafter, but reports the unwarped q: a wrong q."""

    def draft(self, contexts, prefix_logp, width, depth, sampling, seed):
        layers = super().draft(contexts, prefix_logp, width, depth, sampling, seed)
        last = contexts[0][-1]
        for layer in layers:  # one context, width 1: one parent per layer
            layer.q_beam = self.table[last].clone()
            last = layer.tokens[0]
        return layers


def speculative_pvalue(warping: str, drafter=None, runs: int = 3000) -> float:
    """Two tokens after token 0, gamma = 2 drafts per step: every emitted token is the target's."""
    sampling = replace(WARPINGS[warping], max_new_tokens=2)
    drafter = drafter or BigramDrafter(DRAFT_12)
    counts = Counter(tuple(speculative_decode(BigramTarget(TARGET_12), drafter, [0], 2, sampling, seed))
                     for seed in range(runs))
    return chi_square_pvalue(counts, exact_beam_sampling(1, 2, table=TARGET_12, sampling=sampling))


@pytest.mark.slow
@pytest.mark.parametrize("warping", WARPINGS)
def test_speculative_decode_is_distributed_as_warped_multinomial_sampling(warping):
    assert speculative_pvalue(warping) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["resample_from_p", "target_not_warped", "q_not_warped"])
def test_the_decoding_test_catches_bugs_under_warping(bug, monkeypatch):
    """Negative controls, paper warping: a rejected draft resampled from p instead of the residual
    norm(max(0, p - q)); the acceptance test and residual on the unwarped target; a drafter that
    samples from the warped q but reports the unwarped one."""
    drafter = None
    if bug == "resample_from_p":
        monkeypatch.setattr(speculative, "residual_distribution", lambda p, q: p)
    elif bug == "target_not_warped":
        monkeypatch.setattr(speculative, "beam_distribution",
                            lambda prefix, logp, sampling: beam_distribution(prefix, logp, SamplingParams()))
    else:
        drafter = UnwarpedQDrafter(DRAFT_12)
    assert speculative_pvalue("paper", drafter) < 1e-6


def test_prompt_lookup_takes_the_longest_suffix_match_at_its_earliest_place():
    from pipeline.decoding.speculative import prompt_lookup

    context = [1, 2, 3, 9, 5, 2, 3, 7, 8, 1, 2, 3]
    # [1, 2, 3] occurs at 0 (3-gram, longest): what followed it there
    assert prompt_lookup(context, 2, 1, 3) == [9, 5]
    # capped at 2-grams: [2, 3] first occurs at 1
    assert prompt_lookup(context, 3, 1, 2) == [9, 5, 2]
    assert prompt_lookup(context, 9, 1, 3) == [9, 5, 2, 3, 7, 8, 1, 2, 3]  # up to the end of the context
    assert prompt_lookup([4, 5, 6, 7], 3, 1, 3) == []  # no earlier occurrence
    assert prompt_lookup([5, 6, 5], 3, 2, 3) == []  # only a 1-gram matches, below min_n
    assert prompt_lookup([5, 6, 5], 3, 1, 3) == [6, 5]
    assert prompt_lookup(context, 0, 1, 3) == []


def test_speculative_config_checks_its_keys_and_gives_vllm_its_schedule():
    from pipeline.config import config_from_dict
    from pipeline.decoding.speculative import SpeculativeDecoding
    from pipeline.errors import ConfigError

    assert not config_from_dict({}).models.speculative.enabled
    spec = config_from_dict({"models": {"speculative": {"num_speculative_tokens": 3, "max_rows": 8}}}).models.speculative
    assert spec.vllm_config(256) == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                     "prompt_lookup_max": 4,
                                     "num_speculative_tokens_per_batch_size": [(1, 8, 3), (9, 256, 0)]}
    for bad, where in [({"num_speculative_tokens": -1}, "num_speculative_tokens"), ({"method": "eagle"}, "method"),
                       ({"prompt_lookup_min": 5}, "prompt_lookup_min"), ({"max_rows": 0}, "max_rows")]:
        with pytest.raises(ConfigError, match=f"models.speculative.{where}"):
            SpeculativeDecoding(**bad)
