"""The metrics of "Accelerating Best-of-N via Speculative Rejection", section 6 and appendix D.

- Normalized score (Eq. 5 and Eq. 6): 100 * (1 - (max_k s(Z_k) - max_{k in I_accepted} s(Y_k)) /
  (max_k s(Z_k) - min_k s(Z_k))), where Z are Best-of-N's responses. In the counterfactual
  analysis (Eq. 6) Y = Z, so the score is at most 100.
- Token rate (section 6.2): tokens speculative rejection generates over Best-of-N's on the same
  responses. A row stopped at tau costs min(l_k, tau); an accepted row costs l_k. (Eq. 6 as printed
  reads sum_k min(l_k, tau) / sum_k l_k, which is the cost of stopping every row; the accepted
  rows' full length is added here, as the text around it describes.)
- Correlations (appendix D): Pearson and Kendall's tau of partial vs final rewards per prompt.

Pure functions over plain lists; the counterfactual job (jobs.counterfactual) collects the
rewards and the benchmark (benchmarks.sbon) measures the live algorithm with the same formula.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.decoding.speculative_rejection import rejection_cutoff


def normalized_score(reference: list[float], accepted_best: float) -> float:
    """Eq. 5 / Eq. 6 for one prompt: ``reference`` are Best-of-N's final rewards (finite ones are
    used), ``accepted_best`` the best final reward the method kept. NaN when the reference
    rewards are all equal (no range to normalise by)."""
    finite = [r for r in reference if math.isfinite(r)]
    if not finite or max(finite) == min(finite):
        return math.nan
    top, bottom = max(finite), min(finite)
    return 100.0 * (1.0 - (top - max(accepted_best, bottom)) / (top - bottom))


@dataclass
class PromptRewards:
    """One prompt's N full completions with their partial rewards at each decision token."""

    lengths: list[int]
    """l_k: response tokens of each completion."""
    final: list[float]
    """s(Y_k): final reward of each completion."""
    partial: dict[int, list[float]]
    """tau -> s(Y_k^{<= tau_k}) (for a completion shorter than tau: its final reward)."""


def accepted(prompt: PromptRewards, tau: int, alpha: float, keep_lowest: bool = True) -> set[int]:
    """I_accepted (Eq. 4) of Algorithm 1 at (tau, alpha) on pre-collected completions, as a live run
    with the same ``keep_lowest`` (SpeculativeRejectionParams) would decide: the completions that
    go on past tau, and those that ended before it. A completion with no partial reward at tau (NaN:
    no signal) goes on, as in a live run."""
    partial = prompt.partial[tau]
    r_cut = rejection_cutoff(partial, alpha)  # Eq. 3
    # A response of exactly tau tokens has not emitted EOS by tau: live runs can stop it, so may we.
    live = [k for k in range(len(partial)) if prompt.lengths[k] >= tau and math.isfinite(partial[k])]
    floor = min(live, key=lambda k: (partial[k], k)) if keep_lowest and live else None
    return {k for k, r in enumerate(partial)
            if prompt.lengths[k] < tau or not math.isfinite(r) or r >= r_cut or k == floor}  # Eq. 4


def subset(prompt: PromptRewards, keep: list[int]) -> PromptRewards:
    """The completions ``keep`` of ``prompt``, in that order (their indices become 0..len(keep) - 1)."""
    return PromptRewards([prompt.lengths[k] for k in keep], [prompt.final[k] for k in keep],
                         {t: [v[k] for k in keep] for t, v in prompt.partial.items()})


def accepted_in_turn(prompt: PromptRewards, taus: list[int], alpha: float,
                     keep_lowest: bool = True) -> tuple[set[int], dict[int, int]]:
    """Algorithm 1 with several decision tokens in turn (SpeculativeRejectionParams.decision_token as
    a list, the paper's section 7 direction), replayed as a live run decides: at each tau, the
    candidates still in play (those that went on past the previous one) are ranked by ``accepted``;
    those that ended before tau are kept and leave play. Returns (the completions kept, each stopped
    one's tau). With one tau it is ``accepted``."""
    play, done, stopped = list(range(len(prompt.lengths))), set(), {}
    for tau in taus:
        kept = accepted(subset(prompt, play), tau, alpha, keep_lowest)
        going = []
        for i, k in enumerate(play):
            if prompt.lengths[k] < tau:
                done.add(k)
            elif i in kept:
                going.append(k)
            else:
                stopped[k] = tau
        play = going
    return done | set(play), stopped


def chosen(prompt: PromptRewards, kept: set[int]) -> int | None:
    """The completion Algorithm 1 returns out of ``kept``: the best finite final reward (ties: the
    lowest index, as pair selection breaks them); None when none is finite."""
    finite = [k for k in sorted(kept) if math.isfinite(prompt.final[k])]
    return max(finite, key=lambda k: (prompt.final[k], -k)) if finite else None


def simulate(prompt: PromptRewards, tau: int, alpha: float, keep_lowest: bool = True) -> tuple[float, float]:
    """(normalized score, token rate) of Algorithm 1 at (tau, alpha) on pre-collected completions."""
    kept = accepted(prompt, tau, alpha, keep_lowest)
    tokens = sum(prompt.lengths[k] if k in kept else min(prompt.lengths[k], tau) for k in range(len(prompt.lengths)))
    best = max((prompt.final[k] for k in kept if math.isfinite(prompt.final[k])), default=-math.inf)
    return normalized_score(prompt.final, best), tokens / max(1, sum(prompt.lengths))


def grid(prompts: list[PromptRewards], taus: list[int], alphas: list[float], keep_lowest: bool = True) -> list[dict]:
    """Mean normalized score and token rate over prompts for every (tau, alpha)."""
    out = []
    for tau in taus:
        for alpha in alphas:
            runs = [simulate(p, tau, alpha, keep_lowest) for p in prompts]
            scores = [s for s, _ in runs if math.isfinite(s)]
            out.append({"tau": tau, "alpha": alpha,
                        "score": sum(scores) / len(scores) if scores else math.nan,
                        "token_rate": sum(t for _, t in runs) / len(runs)})
    return out


def correlations(prompt: PromptRewards, tau: int) -> tuple[float, float]:
    """(Pearson, Kendall tau-b) of partial at tau vs final rewards; NaN when undefined."""
    from scipy import stats

    pairs = [(x, y) for x, y in zip(prompt.partial[tau], prompt.final) if math.isfinite(x) and math.isfinite(y)]
    if len(pairs) < 3 or len({x for x, _ in pairs}) < 2 or len({y for _, y in pairs}) < 2:
        return math.nan, math.nan
    xs, ys = zip(*pairs)
    return float(stats.pearsonr(xs, ys)[0]), float(stats.kendalltau(xs, ys)[0])
