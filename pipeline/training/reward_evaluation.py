"""Evaluation of a reward model on prompts it never saw:
- pairwise agreement with the judge: the fraction of judge-ordered pairs that the reward model
  orders the same way;
- partial-vs-final reward correlation, as in the speculative-rejection paper, appendix D:
  r(x, y_<=tau) against r(x, y), Pearson and Kendall's tau over the responses longer than tau,
  pooled and per prompt (the paper's statistic, averaged over prompts with at least three such
  responses);
- Best-of-N accuracy: IFEval strict accuracy of the sample the reward model picks per prompt,
  beside a random sample's and the judge's own best and worst.
"""

from __future__ import annotations

import math
import uuid

from pipeline.training.judged_samples import Judgement, Sample


def pairwise_agreement(rewards: list[float], pairs: list[tuple[int, int]]) -> float:
    """Fraction of (chosen, rejected) pairs the rewards order the same way (a tie counts half)."""
    if not pairs:
        return math.nan
    agree = sum(1.0 if rewards[c] > rewards[r] else 0.5 if rewards[c] == rewards[r] else 0.0 for c, r in pairs)
    return agree / len(pairs)



def partial_rewards(scorer, samples: list[Sample], taus: list[int], tokenizer) -> dict[int, dict[int, float]]:
    """tau -> {sample index: r(x, y_<=tau)} for every sample longer than tau, read with streaming
    reward sessions (each tau feeds only the new tokens), a few prompts per session."""
    by_prompt: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        by_prompt.setdefault(s.prompt_id, []).append(i)
    width = max(len(v) for v in by_prompt.values())
    groups = list(by_prompt.values())
    per_session = max(1, scorer.batch_size // width)
    out: dict[int, dict[int, float]] = {tau: {} for tau in taus}
    for start in range(0, len(groups), per_session):
        chunk = groups[start:start + per_session]
        row_of = {i: k * width + j for k, members in enumerate(chunk) for j, i in enumerate(members)}
        session = uuid.uuid4().hex
        scorer.open(session, [samples[m[0]].prompt for m in chunk], width)
        try:
            for tau in sorted(taus):
                live = [i for m in chunk for i in m if len(samples[i].token_ids) > tau]
                if not live:
                    continue
                texts = tokenizer.batch_decode([samples[i].token_ids[:tau] for i in live], skip_special_tokens=True)
                for i, v in zip(live, scorer.extend(session, [row_of[i] for i in live], texts)):
                    out[tau][i] = v
        finally:
            scorer.close(session)
    return out


def partial_final_correlations(samples: list[Sample], final: list[float], partial: dict[int, dict[int, float]]) -> dict:
    """Pearson and Kendall's tau of partial vs final rewards at each tau over the responses longer
    than tau: pooled, and per prompt averaged over prompts (the paper's statistic; a prompt needs
    three such responses). Responses of at most tau tokens are left out of both: their partial
    reward is their final one, which would only inflate the figures."""
    from scipy import stats

    from pipeline.decoding.metrics import PromptRewards, correlations

    out = {}
    for tau, values in sorted(partial.items()):
        index = sorted(values)
        xs, ys = [values[i] for i in index], [final[i] for i in index]
        pooled = (float(stats.pearsonr(xs, ys)[0]), float(stats.kendalltau(xs, ys)[0])) if len(index) >= 3 \
            else (math.nan, math.nan)
        by_prompt: dict[str, list[int]] = {}
        for i in index:
            by_prompt.setdefault(samples[i].prompt_id, []).append(i)
        per_prompt = [correlations(PromptRewards(lengths=[len(samples[i].token_ids) for i in m],
                                                 final=[final[i] for i in m], partial={tau: [values[i] for i in m]}),
                                   tau) for m in by_prompt.values()]
        defined = [(p, k) for p, k in per_prompt if math.isfinite(p) and math.isfinite(k)]
        out[str(tau)] = {
            "responses_longer_than_tau": len(index),
            "pearson": rounded(pooled[0]), "kendall": rounded(pooled[1]),
            "per_prompt_pearson": rounded(sum(p for p, _ in defined) / len(defined)) if defined else None,
            "per_prompt_kendall": rounded(sum(k for _, k in defined) / len(defined)) if defined else None,
            "prompts_with_defined_correlation": len(defined),
        }
    return out


def best_of_n_accuracy(samples: list[Sample], judgements: list[Judgement], rewards: list[float]) -> dict:
    """IFEval strict accuracy (pipeline.judge.accuracy) of: every sample (a random sample's
    expected accuracy), the highest-reward sample of each prompt (Best-of-N with this reward
    model), and the judge's own best and worst sample of each prompt (the bounds)."""
    from pipeline.judge import accuracy

    by_prompt: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        by_prompt.setdefault(s.prompt_id, []).append(i)

    def pick(key):
        return accuracy([judgements[key(m)].followed for m in by_prompt.values()])

    figures = {"random_sample": accuracy([j.followed for j in judgements]),
               "best_of_n_by_reward": pick(lambda m: max(m, key=lambda i: rewards[i])),
               "best_of_n_by_judge": pick(lambda m: max(m, key=lambda i: judgements[i].fraction)),
               "worst_of_n_by_judge": pick(lambda m: min(m, key=lambda i: judgements[i].fraction))}
    return {name: {k: rounded(v) for k, v in f.items()} for name, f in figures.items()}


def rounded(value: float) -> float | None:
    """A figure as reports give it: 4 decimals; None for NaN or infinity (JSON has neither)."""
    return round(value, 4) if value is not None and math.isfinite(value) else None
