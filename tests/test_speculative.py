"""Speculative sampling (Leviathan et al.): the emitted tokens follow the target exactly.

The "models" are bigram tables over a 4-token vocabulary, so the target's distribution over the
first two generated tokens is known in closed form and a chi-square test can check the sampler.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from pipeline.decoding.sampling import inverse_cdf, residual_distribution
from pipeline.decoding.speculative import speculative_sampling

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
