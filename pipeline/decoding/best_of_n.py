"""Best-of-N: sample N responses per prompt to the end, score each with the reward model.

It is the baseline every other method is measured against, and the source of the
``bon_equivalent_tokens`` figure. Speculative rejection with rejection_rate 0 reduces to it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from pipeline.decoding.domain import (Candidate, Generator, PromptInput, PromptResult, RowState, Scorer,
                                      components_of)
from pipeline.decoding.sampling import SamplingParams, row_seed


@dataclass
class BestOfNParams:
    """Best-of-N has no parameters beyond sampling.num_samples."""


def open_session(generator: Generator, prompts: list[PromptInput], num_samples: int,
                 sampling: SamplingParams, seed: int, rewards: bool = False) -> str:
    """A new generator session over ``prompts``, one seed per row; ``rewards``: the rows come back
    with the generator's own rewards (Generator.open), asked only when true."""
    session = uuid.uuid4().hex
    seeds = [row_seed(seed, p.prompt_id, s) for p in prompts for s in range(num_samples)]
    asked = {"rewards": True} if rewards else {}
    generator.open(session, [p.token_ids for p in prompts], num_samples, seeds, sampling, **asked)
    return session


def score_rows(scorer: Scorer, prompts: list[PromptInput], num_samples: int, rows: list[RowState]) -> list[float]:
    """Score (raw prompt, response so far) for each row state; row ids locate the prompt. Each row's
    ``finished`` and its prompt's other columns go along (a reward function reads them). What the
    scorer returns comes back as it is (a composite's Scores keep their components)."""
    if not rows:
        return []
    owners = [prompts[r.row // num_samples] for r in rows]
    return scorer.score([p.reward_input for p in owners], [r.text for r in rows],
                        finished=[r.finished for r in rows], columns=[p.columns for p in owners])


def scored_candidates(rows: list[RowState], scores: list[float], num_samples: int) -> dict[int, Candidate]:
    """Each completed row as a Candidate with its score and its rewards' scores (``components_of``)."""
    return {r.row: Candidate(sample=r.row % num_samples, token_ids=r.token_ids, text=r.text, score=s,
                             completed=True, components=c)
            for r, s, c in zip(rows, scores, components_of(scores))}


def assemble(prompts: list[PromptInput], num_samples: int, candidates: dict[int, Candidate],
             bon_tokens: dict[int, int]) -> list[PromptResult]:
    """Group candidates by prompt, checking that every prompt has exactly num_samples of them."""
    results = []
    for i, prompt in enumerate(prompts):
        rows = [candidates[i * num_samples + s] for s in range(num_samples)]
        results.append(PromptResult(
            prompt=prompt,
            candidates=rows,
            generated_tokens=sum(len(c.token_ids) for c in rows),
            bon_equivalent_tokens=sum(bon_tokens[i * num_samples + s] for s in range(num_samples)),
        ))
    return results


def best_of_n(prompts: list[PromptInput], generator: Generator, scorer: Scorer, params: BestOfNParams,
              sampling: SamplingParams, num_samples: int, seed: int) -> list[PromptResult]:
    session = open_session(generator, prompts, num_samples, sampling, seed)
    try:
        rows = generator.extend(session, until=sampling.max_new_tokens)
    finally:
        generator.close(session)
    assert len(rows) == len(prompts) * num_samples, "generator lost or duplicated rows"
    candidates = scored_candidates(rows, score_rows(scorer, prompts, num_samples, rows), num_samples)
    return assemble(prompts, num_samples, candidates, {r.row: len(r.token_ids) for r in rows})
