"""Pair selection: from one prompt's scored candidates to one (chosen, rejected) row.

- chosen: the completed candidate with the highest finite reward. A candidate stopped early by
  speculative rejection is never chosen (its text is unfinished).
- rejected (``rejected="complete"``, the default): the completed candidate with the lowest finite
  reward among the others, so both sides are finished responses with final rewards. With
  ``rejected="any"``, a candidate stopped early may be it too (then ``rejected_is_partial`` is true
  and its score is the partial reward at the stop, and min_margin, which compares final rewards
  only, does not apply). A candidate whose text equals the chosen text is skipped.
- Failed candidates (non-finite reward) are never used and are counted.
- No pair (a reject with its reason) when no completed candidate has a finite reward, when no
  other usable candidate is left, when the best and worst scores tie, or when their margin is
  below ``min_margin`` (data.min_margin).

The row is in TRL's standard format (prompt, chosen, rejected strings) or, with
``output_format="conversational"``, its conversational format: prompt is the list of messages
(a string prompt becomes one user turn), chosen and rejected are one assistant turn each.
"""

from __future__ import annotations

from pipeline.decoding.domain import PromptResult


def select_pair(result: PromptResult, strategy: str, min_margin: float = 0.0, output_format: str = "standard",
                rejected_from: str = "complete", candidates: bool = False) -> tuple[dict | None, str | None]:
    """Returns (pair row, None) or (None, reason). ``candidates`` (data.candidate_scores): the row
    also lists every candidate's score, generated tokens and early stop, by sample index
    (pipeline.data.schema.CANDIDATE_FIELDS)."""
    usable = [c for c in result.candidates if not c.failed]
    completed = [c for c in usable if c.completed and not c.stopped_early]
    if not completed:
        return None, "no completed candidate with a finite reward"
    chosen = max(completed, key=lambda c: (c.score, -c.sample))
    pool = usable if rejected_from == "any" else completed
    others = [c for c in pool if c is not chosen and c.text != chosen.text]
    if not others:
        kind = "candidate" if rejected_from == "any" else "completed candidate"
        return None, f"no second distinct {kind} with a finite reward"
    rejected = min(others, key=lambda c: (c.score, c.sample))
    if rejected.score >= chosen.score:
        return None, f"tie: best and worst reward are equal ({chosen.score:.6g})"
    if not rejected.stopped_early and chosen.score - rejected.score < min_margin:
        return None, f"margin below min_margin ({chosen.score - rejected.score:.6g} < {min_margin:g})"
    p = result.prompt
    prompt, chosen_text, rejected_text = p.text, chosen.text, rejected.text
    if output_format == "conversational":
        prompt = p.messages if p.messages is not None else [{"role": "user", "content": p.raw_prompt}]
        chosen_text = [{"role": "assistant", "content": chosen.text}]
        rejected_text = [{"role": "assistant", "content": rejected.text}]
    row = {
        "prompt_id": p.prompt_id,
        "prompt": prompt,
        "chosen": chosen_text,
        "rejected": rejected_text,
        "chosen_score": float(chosen.score),
        "rejected_score": float(rejected.score),
        # each reward's, from the call that gave the score (Candidate.components)
        "chosen_scores": [float(v) for v in chosen.components or [chosen.score]],
        "rejected_scores": [float(v) for v in rejected.components or [rejected.score]],
        "strategy": strategy,
        "num_candidates": len(result.candidates),
        "generated_tokens": int(result.generated_tokens),
        "bon_equivalent_tokens": int(result.bon_equivalent_tokens),
        "rejected_is_partial": bool(rejected.stopped_early),
        "chosen_sample": int(chosen.sample),
        "rejected_sample": int(rejected.sample),
        "stopped_early": sum(c.stopped_early for c in result.candidates),
        "failed_candidates": len(result.candidates) - len(usable),
        "raw_prompt": p.raw_prompt,
        # The exact ids the generator conditioned on and sampled (no EOS): what SLA's Reward
        # Transformer scores, so its training reads them rather than re-tokenized text.
        "prompt_token_ids": list(p.token_ids),
        "chosen_token_ids": list(chosen.token_ids),
        "rejected_token_ids": list(rejected.token_ids),
    }
    if candidates:
        ordered = sorted(result.candidates, key=lambda c: c.sample)
        row.update(candidate_scores=[float(c.score) for c in ordered],
                   candidate_tokens=[len(c.token_ids) for c in ordered],
                   candidate_stopped_early=[bool(c.stopped_early) for c in ordered])
    return row, None
