"""Speculative rejection (Speculative Best-of-N), Algorithm 1 of
"Accelerating Best-of-N via Speculative Rejection" (Sun et al., 2024).

Terms (paper section 5):
- N candidates Y_1..Y_N are sampled for a prompt X up to the decision token tau
  (tau_k = min(tau, l_k): a sequence that hits EOS earlier stops there).
- Partial rewards R_partial = {s(Y_k^{<=tau_k})} (Eq. 2) come from the reward model s on
  prompt plus partial response.
- The cutoff r_cut = q_alpha(R_partial) is the alpha lower quantile of the partial rewards
  (Eq. 3), alpha = ``rejection_rate``.
- I_accepted = {k : s(Y_k^{<=tau_k}) >= r_cut} (Eq. 4) keep generating to EOS or the length
  cap; the others stop. Sequences that ended before tau are kept unchanged.
- The output is argmax over I_accepted of the final reward s(Y_k).

The quantile follows the authors' public code: rank the candidates by partial reward and keep
the top ``round((1 - alpha) * n)`` of them (at least one), so r_cut is the score of the last
kept one; ties with r_cut are also kept, as Eq. 4's ">=" says. With alpha = 0 every candidate
is kept and the result equals Best-of-N's for the same seeds.

``decision_token`` may be a list: rejection then happens at each point in turn, ranking the
candidates still in play (the paper's "multiple decision tokens" direction, section 7).
Non-finite partial rewards mark a candidate as failed; the quantile uses finite scores only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.decoding.best_of_n import assemble, open_session, score_rows
from pipeline.decoding.protocols import Candidate, Generator, PromptInput, PromptResult, Scorer
from pipeline.decoding.sampling import SamplingParams


@dataclass
class SpeculativeRejectionParams:
    decision_token: int | list = 32
    """tau: generated tokens before the reward model ranks the partial responses (or a list)."""
    rejection_rate: float = 0.5
    """alpha in [0, 1): the fraction of partial responses stopped at each decision token."""

    def __post_init__(self):
        from pipeline.config import ConfigError

        taus = self.decision_token if isinstance(self.decision_token, list) else [self.decision_token]
        if not taus or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in taus):
            raise ConfigError(f"strategy.decision_token: expected a positive int or a list of them, got {self.decision_token!r}")
        if not 0 <= self.rejection_rate < 1:
            raise ConfigError(f"strategy.rejection_rate: must be in [0, 1), got {self.rejection_rate}")

    @property
    def decision_tokens(self) -> list[int]:
        taus = self.decision_token if isinstance(self.decision_token, list) else [self.decision_token]
        return sorted(set(taus))


def rejection_cutoff(partial_rewards: list[float], rejection_rate: float) -> float:
    """r_cut = q_alpha(R_partial) (Eq. 3), over the finite rewards; -inf keeps everything."""
    finite = sorted(r for r in partial_rewards if math.isfinite(r))
    if not finite:
        return -math.inf
    keep = max(1, int(round((1.0 - rejection_rate) * len(finite))))
    return finite[len(finite) - keep]


def speculative_rejection(prompts: list[PromptInput], generator: Generator, scorer: Scorer,
                          params: SpeculativeRejectionParams, sampling: SamplingParams,
                          num_samples: int, seed: int) -> list[PromptResult]:
    session = open_session(generator, prompts, num_samples, sampling, seed)
    candidates: dict[int, Candidate] = {}
    live = list(range(len(prompts) * num_samples))  # rows still decoding
    try:
        for tau in [t for t in params.decision_tokens if t < sampling.max_new_tokens]:
            if not live:
                break
            rows = generator.extend(session, until=tau, keep=live)  # Alg. 1 line 2
            scores = score_rows(scorer, prompts, num_samples, rows)  # Eq. 2
            by_prompt: dict[int, list[int]] = {}
            for r, s in zip(rows, scores):
                candidates[r.row] = Candidate(sample=r.row % num_samples, token_ids=r.token_ids, text=r.text,
                                              score=s, completed=r.finished)
                by_prompt.setdefault(r.row // num_samples, []).append(r.row)
            live = []
            for members in by_prompt.values():
                r_cut = rejection_cutoff([candidates[m].score for m in members], params.rejection_rate)  # Eq. 3
                for m in members:
                    c = candidates[m]
                    if c.completed or c.failed:
                        continue  # ended before tau: kept unchanged; failed: never continued
                    if c.score >= r_cut:  # Eq. 4
                        live.append(m)
                    else:
                        c.stopped_early, c.stopped_at = True, tau
        if live:  # Alg. 1 line 5: finish the accepted sequences
            rows = generator.extend(session, until=sampling.max_new_tokens, keep=live)
            for r, s in zip(rows, score_rows(scorer, prompts, num_samples, rows)):
                candidates[r.row] = Candidate(sample=r.row % num_samples, token_ids=r.token_ids, text=r.text,
                                              score=s, completed=True)
    finally:
        generator.close(session)
    missing = set(range(len(prompts) * num_samples)) - set(candidates)
    assert not missing, f"speculative rejection lost rows {sorted(missing)[:5]}"
    return assemble(prompts, num_samples, candidates, _bon_tokens(candidates, num_samples, sampling))


def _bon_tokens(candidates: dict[int, Candidate], num_samples: int, sampling: SamplingParams) -> dict[int, int]:
    """Tokens Best-of-N would have spent per row. A stopped row's full length is unknown; it is
    estimated as the mean length of the completed rows of its prompt that outlived the same
    decision token (the max length when none did), and never less than what it already has."""
    out = {}
    for row, c in candidates.items():
        if not c.stopped_early:
            out[row] = len(c.token_ids)
            continue
        prompt = row // num_samples
        peers = [len(o.token_ids) for r, o in candidates.items()
                 if r // num_samples == prompt and o.completed and len(o.token_ids) > c.stopped_at]
        estimate = round(sum(peers) / len(peers)) if peers else sampling.max_new_tokens
        out[row] = max(len(c.token_ids), estimate)
    return out
