"""DSBD and beam sampling with EOS (pipeline.decoding.dsbd, module docstring): a beam stops at its
first EOS (absorbing: its likelihood no longer changes), decoding stops once every beam has ended,
and the answer is the complete beam with the lowest perplexity (mean log-likelihood per token, EOS
included), never ranked by tokens after an EOS. Checked against the exact law of that beam
sampling on a bigram "model" (tests.bigram_models), for the beam sampler and for DSBD."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import torch

from pipeline.decoding.dsbd import DecodeStats, DSBDParams, beam_sampling, dsbd_decode
from pipeline.decoding.sampling import SamplingParams, beam_distribution, cut_response
from tests.bigram_models import DRAFT, BigramDrafter, BigramTarget, chi_square_pvalue, exact_beam_sampling

EOS = 2
# After the prompt's token 0, EOS is likely and a complete empty response has the best per-token
# likelihood; the long beams (1 1 1) are likely per token but unlikely to start. Row EOS (what a
# decoder that went on past EOS would read) is flat, so ranking beams by their whole likelihood,
# tokens after EOS included, would prefer the long beams: the two rankings have far apart laws.
EOS_TARGET = torch.tensor([[0.25, 0.15, 0.6], [0.05, 0.9, 0.05], [0.34, 0.33, 0.33]])
EOS_DRAFT = 0.5 * EOS_TARGET + 0.5 * DRAFT
SAMPLING = SamplingParams(max_new_tokens=3)


def _rank(beam) -> float:
    tokens, logp, ended_at = beam
    return logp / max(1, ended_at if ended_at is not None else len(tokens))


def eos_beam_sampling_law(width: int, steps: int, table: torch.Tensor = EOS_TARGET, start: int = 0,
                          sampling: SamplingParams = SAMPLING) -> dict[tuple, float]:
    """The law of beam sampling's answer with an absorbing EOS, by enumeration: every step draws
    ``width`` beams iid from p_beam (Eq. 1), where an ended beam's only continuation is EOS with
    log-prob 0; the answer is the final beam with the highest mean log-likelihood (lowest
    perplexity), cut before its EOS. Enumerated independently of the decoder's code: multisets of
    draws with their multinomial weights."""
    log_table = table.log()
    vocab = table.shape[-1]
    law: dict[tuple, float] = {}

    def walk(beams: tuple, left: int, weight: float) -> None:
        if left == 0 or all(b[2] is not None for b in beams):
            best = max(beams, key=_rank)
            answer = tuple(cut_response(list(best[0]), sampling.max_new_tokens, {EOS}))
            law[answer] = law.get(answer, 0.0) + weight
            return
        nxt = torch.stack([torch.where(torch.arange(vocab) == EOS, 0.0, -math.inf) if b[2] is not None
                           else log_table[b[0][-1] if b[0] else start] for b in beams])  # [W, V]
        p = beam_distribution(torch.tensor([b[1] for b in beams]), nxt, sampling).double().tolist()
        support = [x for x, px in enumerate(p) if px > 0]
        for draws in itertools.combinations_with_replacement(support, width):
            orderings = math.factorial(width) / math.prod(math.factorial(n) for n in Counter(draws).values())
            grown = []
            for x in draws:
                tokens, logp, ended_at = beams[x // vocab]
                token = x % vocab
                if ended_at is None:
                    logp += float(nxt[x // vocab, token])
                    ended_at = len(tokens) + 1 if token == EOS else None
                grown.append((tokens + (token,), logp, ended_at))
            walk(tuple(grown), left - 1, weight * orderings * math.prod(p[x] for x in draws))

    walk((((), 0.0, None),), steps, 1.0)
    return law


def test_the_law_differs_from_ranking_by_total_likelihood():
    """Power check: decoding on past EOS and ranking by the whole likelihood (what the decoders did
    before) gives another law, far enough from this one for the tests below to tell them apart (they
    fail on the decoders as they were)."""
    law = eos_beam_sampling_law(2, 3)
    assert abs(sum(law.values()) - 1) < 1e-6
    past_eos: dict[tuple, float] = {}
    for seq, q in exact_beam_sampling(width=2, steps=3, table=EOS_TARGET).items():
        answer = tuple(cut_response(list(seq), 3, {EOS}))
        past_eos[answer] = past_eos.get(answer, 0.0) + q
    distance = sum(abs(law.get(k, 0.0) - past_eos.get(k, 0.0)) for k in set(law) | set(past_eos)) / 2
    assert distance > 0.03  # at 2500 runs, mostly in the empty answer's cell: ~4.5 standard deviations


def test_beam_sampling_stops_beams_at_eos_and_ranks_complete_beams_by_perplexity():
    runs = 2500
    counts = Counter(tuple(beam_sampling(BigramTarget(EOS_TARGET), [0], 2, SAMPLING, seed, eos_ids={EOS}))
                     for seed in range(runs))
    assert chi_square_pvalue(counts, eos_beam_sampling_law(2, 3)) > 1e-3


def test_dsbd_with_eos_is_distributed_as_beam_sampling_with_eos():
    """Theorem 3.1 still holds with ended beams absorbed: DSBD's answer has the law above."""
    runs = 2500
    params = DSBDParams(draft_width=3, num_draft_layers=2)
    counts = Counter(tuple(dsbd_decode(BigramTarget(EOS_TARGET), BigramDrafter(EOS_DRAFT), [0], params, SAMPLING, seed, {EOS},
                                       fixed_width=2)) for seed in range(runs))
    assert chi_square_pvalue(counts, eos_beam_sampling_law(2, 3)) > 1e-3


def test_decoding_stops_once_every_beam_has_ended():
    """A model that always says EOS first: one step ends every beam, and nothing is decoded past it
    (before, both decoders ran to max_new_tokens)."""
    table = torch.tensor([[0.01, 0.01, 0.98], [0.01, 0.01, 0.98], [0.3, 0.3, 0.4]])
    always_eos = torch.tensor([[0.0, 0.0, 1.0]] * 3)  # first step: EOS surely
    sampling = SamplingParams(max_new_tokens=8)
    stats = DecodeStats()
    assert beam_sampling(BigramTarget(always_eos), [0], 3, sampling, 0, eos_ids={EOS}, stats=stats) == []
    assert stats.target_forwards == 1 and stats.steps == 1
    stats = DecodeStats()
    out = dsbd_decode(BigramTarget(table), BigramDrafter(table), [0], DSBDParams(draft_width=3, num_draft_layers=2),
                      sampling, 1, {EOS}, stats=stats, fixed_width=2)
    assert len(out) < 8 and stats.steps < 8  # ended early, not decoded to the cap
