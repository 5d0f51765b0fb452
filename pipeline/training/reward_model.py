"""A sequence-classification reward model trained the way real ones are: Bradley-Terry on pairs of
complete responses (never prefixes) that the policy itself sampled, labeled by a judge.

The backbone is the policy's own network, frozen; only the score head learns. For a pair
(y_w, y_l) of responses to one prompt x,

    L = -log sigmoid(r(x, y_w) - r(x, y_l)) + l2 * |w|^2,    r(x, y) = w . h(x, y)

where h(x, y) is the backbone's final hidden state at the last token of the chat-formatted
conversation (what LlamaForSequenceClassification pools) and w the head (``score.weight``, no
bias: a constant does not change a preference). The features are computed once (the judge's
conversation pass yields them, pipeline.judge.RubricJudge.rate), standardized for the fit, and
the standardization is folded back into w, so the saved model scores raw text. The fit is
full-batch L-BFGS, deterministic; l2 is chosen on held-out training prompts.

Evaluation on prompts the model never saw:
- pairwise agreement with the judge: the fraction of judge-ordered pairs (scores at least
  ``margin`` apart) that the reward model orders the same way;
- partial-vs-final reward correlation, as in "Accelerating Best-of-N via Speculative Rejection",
  appendix D: r(x, y_<=tau) (the first tau generated tokens) against r(x, y), Pearson and
  Kendall's tau over the responses longer than tau, pooled and per prompt (the paper's
  statistic, averaged over the prompts with at least three such responses).
"""

from __future__ import annotations

import math
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.decoding.sampling import SamplingParams, row_seed


@dataclass
class Sample:
    """One complete response the policy sampled."""

    prompt: str | list[dict]
    """What the reward model and the judge read before the response (PromptInput.reward_input)."""
    prompt_id: str
    sample: int
    token_ids: list[int]
    """Generated tokens, EOS excluded."""
    text: str
    eos: bool
    """True when the response ended with EOS, False when it reached the token cap."""


def sample_responses(engine, prompts, num_samples: int, max_new_tokens: int, temperature: float, seed: int,
                     rows_per_batch: int = 128, progress=None) -> list[Sample]:
    """``num_samples`` seeded samples of each prompt (pipeline.decoding.protocols.PromptInput) with
    ``engine`` (an HFEngine), in batches of about ``rows_per_batch`` rows."""
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    per_batch = max(1, rows_per_batch // num_samples)
    out = []
    for start in range(0, len(prompts), per_batch):
        chunk = prompts[start:start + per_batch]
        seeds = [row_seed(seed, p.prompt_id, s) for p in chunk for s in range(num_samples)]
        rows = engine.generate([p.token_ids for p in chunk], num_samples, seeds, sampling)
        for row in rows:
            p = chunk[row.row // num_samples]
            out.append(Sample(p.reward_input, p.prompt_id, row.row % num_samples, list(row.token_ids), row.text,
                              eos=len(row.token_ids) < max_new_tokens))
        if progress is not None:
            progress.update(len(chunk))
    return out


def preference_pairs(groups: list[str], scores: list[float], margin: float) -> list[tuple[int, int]]:
    """(chosen, rejected) index pairs: every two responses of one group (prompt) whose judge
    scores differ, by at least ``margin``; the higher one is chosen."""
    members: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    pairs = []
    for index in members.values():
        for a, i in enumerate(index):
            for j in index[a + 1:]:
                gap = abs(scores[i] - scores[j])
                if gap > 0 and gap >= margin:
                    pairs.append((i, j) if scores[i] > scores[j] else (j, i))
    return pairs


def fit_head(features: torch.Tensor, pairs: list[tuple[int, int]], l2: float, steps: int = 200) -> torch.Tensor:
    """The Bradley-Terry head w ([H], in raw feature space) for features [N, H] and pairs."""
    if not pairs:
        raise ValueError("no preference pairs to train on: every response scored the same")
    x = features.double()
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    z = (x - mean) / std  # [N, H]
    chosen, rejected = torch.tensor([c for c, _ in pairs]), torch.tensor([r for _, r in pairs])
    diff = z[chosen] - z[rejected]  # [P, H]
    w = torch.zeros(z.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=steps, history_size=20, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-9, tolerance_change=1e-12)

    def closure():
        opt.zero_grad()
        loss = F.softplus(-(diff @ w)).mean() + l2 * (w @ w)
        loss.backward()
        return loss

    opt.step(closure)
    return (w.detach() / std).float()


def pairwise_agreement(rewards: list[float], pairs: list[tuple[int, int]]) -> float:
    """Fraction of (chosen, rejected) pairs the rewards order the same way (a tie counts half)."""
    if not pairs:
        return math.nan
    agree = sum(1.0 if rewards[c] > rewards[r] else 0.5 if rewards[c] == rewards[r] else 0.0 for c, r in pairs)
    return agree / len(pairs)


def choose_l2(features: torch.Tensor, groups: list[str], scores: list[float], margin: float,
              grid: tuple[float, ...] = (1e-4, 1e-3, 1e-2, 1e-1), holdout_every: int = 8) -> tuple[float, dict]:
    """The l2 of ``grid`` whose head, fit on all but every ``holdout_every``-th prompt, agrees best
    with the judge on the pairs of those held-out prompts (ties: the stronger l2)."""
    names = list(dict.fromkeys(groups))
    held = {g for k, g in enumerate(names) if k % holdout_every == holdout_every - 1}
    fit_index = [i for i, g in enumerate(groups) if g not in held]
    val_index = [i for i, g in enumerate(groups) if g in held]
    fit_pairs = preference_pairs([groups[i] for i in fit_index], [scores[i] for i in fit_index], margin)
    val_pairs = preference_pairs([groups[i] for i in val_index], [scores[i] for i in val_index], margin)
    if not fit_pairs or not val_pairs:
        return grid[len(grid) // 2], {}
    results = {}
    for l2 in grid:
        w = fit_head(features[fit_index], fit_pairs, l2)
        results[l2] = pairwise_agreement((features[val_index] @ w).tolist(), val_pairs)
    best = max(grid, key=lambda l2: (results[l2], l2))
    return best, {str(k): round(v, 4) for k, v in results.items()}


def save_reward_model(backbone: str | Path, head: torch.Tensor, output: str | Path) -> Path:
    """An AutoModelForSequenceClassification directory at ``output``: the backbone's weights (a
    causal LM directory), ``score`` = the head, and the backbone's tokenizer (chat template
    included), written to a temp dir and renamed into place."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging

    from pipeline.engines.hf import load_tokenizer

    output = Path(output)
    tokenizer = load_tokenizer(str(backbone))
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the score head is new by design: no "newly initialized" warning
    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(backbone), num_labels=1, dtype=torch.float32)
    finally:
        logging.set_verbosity(verbosity)
    with torch.no_grad():
        model.score.weight.copy_(head.reshape(1, -1))
    model.config.pad_token_id = tokenizer.pad_token_id
    tmp = output.with_name(f"{output.name}.tmp-{uuid.uuid4().hex[:8]}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(output, ignore_errors=True)
    tmp.rename(output)
    return output


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

    from pipeline.decoding.sbon_analysis import PromptRewards, correlations

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
            "pearson": _round(pooled[0]), "kendall": _round(pooled[1]),
            "per_prompt_pearson": _round(sum(p for p, _ in defined) / len(defined)) if defined else None,
            "per_prompt_kendall": _round(sum(k for _, k in defined) / len(defined)) if defined else None,
            "prompts_with_defined_correlation": len(defined),
        }
    return out


def _round(value: float) -> float | None:
    return round(value, 4) if math.isfinite(value) else None
