"""Bigram "models" for the distribution tests of the speculative decoders (pipeline.decoding.dsbd
and pipeline.decoding.speculative): a target and a drafter whose next-token distribution depends
on the last token only, the exact law of beam sampling's output over them, and a chi-square test
of sampled outputs against that law. Vocabularies are tiny, so the law can be enumerated and the
test has power."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import torch
from scipy.stats import chisquare

from pipeline.decoding.domain import DraftLayer
from pipeline.decoding.sampling import SamplingParams, beam_distribution, inverse_cdf

V = 3
TARGET = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.3, 0.3, 0.4]])
DRAFT = torch.tensor([[0.4, 0.4, 0.2], [0.3, 0.4, 0.3], [0.2, 0.2, 0.6]])


def random_table(vocab: int, seed: int, spread: float = 1.0) -> torch.Tensor:
    """A [V, V] bigram table, row a = p(. | a): softmax of N(0, spread^2) logits. Generic values, so
    no two different sequences tie in likelihood."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, vocab, generator=g) * spread).softmax(-1)


class BigramTarget:
    """A ForestTarget (pipeline.decoding.dsbd) over a bigram table: log-probs after each tree node
    depend on the node's token only, so the cache operations have nothing to do."""

    forward_passes = 0

    def __init__(self, table: torch.Tensor = TARGET):
        self.table = table

    def open(self, prompt):
        pass

    def verify(self, trees):
        n = max(len(t.tokens) for t in trees)
        out = torch.zeros((len(trees), n, self.table.shape[-1]))  # [B, N, V]
        for b, t in enumerate(trees):
            out[b, :len(t.tokens)] = self.table[t.tokens].log()
        return out

    def commit(self, sources):
        pass


class BigramDrafter:
    """A Drafter that beam-samples the draft forest from a bigram table (DSBD section 3.1): layer
    l's nodes are iid from q_beam over (node of layer l - 1, token), warped like the target's p_beam,
    each node weighted by its context's prefix_logp plus the draft's log-likelihood of its path."""

    def __init__(self, table: torch.Tensor = DRAFT):
        self.table = table

    def draft(self, contexts, prefix_logp, width, depth, sampling, seed):
        vocab = self.table.shape[-1]
        g = torch.Generator().manual_seed(seed)
        last = torch.tensor([c[-1] for c in contexts])
        scores = torch.tensor(prefix_logp)
        layers = []
        for _ in range(depth):
            logq = self.table[last].log()  # [parents, V]
            q_beam = beam_distribution(scores, logq, sampling)
            flat = inverse_cdf(q_beam[None].expand(width, -1), torch.rand(width, generator=g))
            parents, tokens = flat // vocab, flat % vocab
            layers.append(DraftLayer(parents.tolist(), tokens.tolist(), q_beam))
            scores, last = scores[parents] + logq[parents, tokens], tokens
        return layers


# -- the exact law of beam sampling ------------------------------------------------------------

Beams = tuple  # ((tokens, logp), ...): tokens generated so far (a tuple), their target log-likelihood


def _p_beam(beams: Beams, table: torch.Tensor, sampling: SamplingParams, start: int) -> list[float]:
    """p_beam (Eq. 1) over flat (beam * V + token), computed as the decoders compute it."""
    last = [tokens[-1] if tokens else start for tokens, _ in beams]
    return beam_distribution(torch.tensor([logp for _, logp in beams]), table[last].log(), sampling).double().tolist()


def final_beam_law(beams: Beams, widths: list[int], table: torch.Tensor, sampling: SamplingParams,
                   start: int = 0, memo: dict | None = None) -> dict[tuple, float]:
    """Law of beam sampling's answer, the likeliest final beam (ties: the first drawn, as ``max``
    over the beam list picks it), when it goes on from ``beams`` for len(widths) steps, step i drawing
    widths[i] beams iid from p_beam (paper section 2.1, Eq. 1).

    The steps but the last are enumerated (each multiset of draws with its multinomial weight).
    At the last step, the best of W iid draws is sequence s with probability
    (p_s / g) * (F_le^W - F_lt^W): F_le (F_lt) is the p_beam mass of the sequences at most as
    likely as s (less likely), g that of s's tie class, of which s must be the first drawn.
    Log-likelihoods are summed in the decoders' order and precision (python floats of float32
    log-probs), so ties are the decoders' ties."""
    memo = {} if memo is None else memo
    key = (tuple(sorted(beams)), tuple(widths))
    if key in memo:
        return memo[key]
    vocab = table.shape[-1]
    log_table = table.log()
    p = _p_beam(beams, table, sampling, start)
    support = [x for x, px in enumerate(p) if px > 0]

    def grown(x: int) -> tuple[tuple, float]:
        tokens, logp = beams[x // vocab]
        last = tokens[-1] if tokens else start
        return tokens + (x % vocab,), logp + float(log_table[last, x % vocab])

    law: dict[tuple, float] = {}
    width = widths[0]
    if len(widths) == 1:
        mass: dict[tuple, float] = {}
        likelihood: dict[tuple, float] = {}
        for x in support:
            seq, logp = grown(x)
            mass[seq] = mass.get(seq, 0.0) + p[x]
            likelihood[seq] = logp
        tie_mass = Counter()
        for seq, logp in likelihood.items():
            tie_mass[logp] += mass[seq]
        below = 0.0
        for logp in sorted(tie_mass):  # tie classes, least likely first
            g = tie_mass[logp]
            for seq in (s for s in likelihood if likelihood[s] == logp):
                law[seq] = mass[seq] / g * ((below + g) ** width - below ** width)
            below += g
    else:
        for draws in itertools.combinations_with_replacement(support, width):
            orderings = math.factorial(width) / math.prod(math.factorial(n) for n in Counter(draws).values())
            weight = orderings * math.prod(p[x] for x in draws)
            for seq, q in final_beam_law(tuple(grown(x) for x in draws), widths[1:], table, sampling, start,
                                         memo).items():
                law[seq] = law.get(seq, 0.0) + weight * q
    memo[key] = law
    return law


def exact_beam_sampling(width: int, steps: int, start: int = 0, table: torch.Tensor = TARGET,
                        sampling: SamplingParams = SamplingParams(max_new_tokens=3)) -> dict[tuple, float]:
    """Law of the answer of beam sampling at width ``width`` for ``steps`` steps after the token
    ``start`` (width 1: multinomial sampling of the warped target)."""
    return final_beam_law((((), 0.0),), [width] * steps, table, sampling, start)


def chi_square_pvalue(observed: Counter, law: dict[tuple, float], min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit of outcome counts to an exact law. An outcome the law gives no
    mass makes it 0; outcomes expected fewer than ``min_expected`` times are pooled into one cell."""
    runs = sum(observed.values())
    if any(law.get(k, 0.0) <= 0 for k in observed):
        return 0.0
    total = sum(law.values())
    cells = sorted((law[k] / total * runs, observed.get(k, 0)) for k in law if law[k] > 0)
    small = [c for c in cells if c[0] < min_expected]
    big = [c for c in cells if c[0] >= min_expected]
    pooled = (sum(e for e, _ in small), sum(o for _, o in small))
    if small and pooled[0] < min_expected and big:  # still too small: join the least likely big cell
        e, o = big.pop(0)
        pooled = (pooled[0] + e, pooled[1] + o)
    cells = big + ([pooled] if small else [])
    if len(cells) < 2:
        return 1.0
    return float(chisquare([o for _, o in cells], [e for e, _ in cells]).pvalue)


class HostState:
    """What every fake search host shares with a real engine: per-engine state kept by key
    (``remember``) and token ids decoded to text (here the ids joined by spaces)."""

    def __init__(self):
        self.state: dict = {}

    def remember(self, key, make):
        if key not in self.state:
            self.state[key] = make()
        return self.state[key]

    def decode(self, token_lists):
        return [" ".join(map(str, tokens)) for tokens in token_lists]
