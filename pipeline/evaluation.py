"""Decoding methods compared against greedy decoding, as in Table 1 of "Streaming Looking Ahead
with Token-level Self-reward": one response per prompt and method, all judged by the external
reward model that labeled the training pairs.

- win rate against greedy = (wins + ties / 2) / prompts, a tie being an equal judge score (the
  paper's definition; identical responses tie);
- decoding cost relative to greedy = tokens the method decoded / tokens greedy decoded, and the
  same ratio of wall time (both measured in this run, on the same model and prompts).

Methods and their settings follow section 5: temperature 0.8, top-p 0.9, top-k 50, beam search
with 4 beams (the sampling baselines), and any method of the registry (pipeline.methods), run
through its record as a build runs it: SLA (d, k, n from SLAParams; children sampled at
``sla_temperature``; one search per prompt) and speculative rejection (Best-of-N with early
stopping, N = ``num_samples``, which picks its response with the judge itself, so its win rate is
an upper reference, not a like-for-like one) by default; the others with their default parameters
and N = ``num_samples``. A method's response is its best completed candidate by the judge.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pipeline.decoding.protocols import PromptInput
from pipeline.decoding.sampling import SamplingParams, row_seed
from pipeline.decoding.sla import SLAParams
from pipeline.decoding.speculative_rejection import SpeculativeRejectionParams
from pipeline.methods import METHODS as REGISTRY
from pipeline.methods import method as registered

# The baselines: sampling settings of section 5 (HFEngine.generate), and HF beam search.
SAMPLING = {"greedy": {"temperature": 0.0}, "temperature": {"temperature": 0.8}, "top_p": {"top_p": 0.9},
            "top_k": {"top_k": 50}}
BEAMS = 4
CHOICES = (*SAMPLING, "beam", *REGISTRY)
"""Everything ``decode`` runs: the baselines, then every registered method."""
DEFAULT_METHODS = ("greedy", "temperature", "top_p", "top_k", "beam", "sla", "sbon")
"""What jobs.evaluate compares when not told (Table 1's rows, plus speculative rejection)."""


@dataclass
class MethodRun:
    name: str
    texts: list[str]
    generated_tokens: int
    wall_seconds: float
    forward_passes: int | None = None
    """Sequential model calls (batched rows count once); None for beam search (HF generate)."""
    scores: list[float] = field(default_factory=list)


def decode(method: str, engine, scorer, prompts: list[PromptInput], max_new_tokens: int, seed: int = 0,
           sla_params: SLAParams | None = None, sla_temperature: float = 1.0, num_samples: int = 8) -> MethodRun:
    """One response per prompt with ``method`` on ``engine`` (an HFEngine)."""
    ids = [p.token_ids for p in prompts]
    seeds = [row_seed(seed, p.prompt_id, 0) for p in prompts]
    passes = engine.forward_passes
    start = time.perf_counter()
    if method in SAMPLING:
        rows = engine.generate(ids, 1, seeds, SamplingParams(max_new_tokens=max_new_tokens, **SAMPLING[method]))
        texts, tokens = [r.text for r in rows], sum(len(r.token_ids) for r in rows)
    elif method == "beam":
        texts, tokens = _beam_search(engine, ids, max_new_tokens)
    elif method in REGISTRY:
        record = registered(method)
        params, sampling, n = record.params(), SamplingParams(max_new_tokens=max_new_tokens), num_samples
        if method == "sla":  # one search per prompt, children at sla_temperature
            params, n = sla_params or SLAParams(), 1
            sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=sla_temperature)
        elif method == "sbon":
            params = SpeculativeRejectionParams(decision_token=max(1, max_new_tokens // 4), rejection_rate=0.5)
        results = record.run(prompts, engine, scorer, params, sampling, n, seed)
        # The best completed candidate by the judge (every one failing: the first, so no prompt is lost).
        texts = [max((c for c in r.candidates if c.completed and not c.failed), key=lambda c: c.score,
                     default=r.candidates[0]).text for r in results]
        tokens = sum(r.generated_tokens for r in results)
    else:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(CHOICES)}")
    wall = time.perf_counter() - start
    return MethodRun(method, texts, tokens, wall, None if method == "beam" else engine.forward_passes - passes)


@torch.inference_mode()
def _beam_search(engine, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[str], int]:
    """HF beam search on the policy, one prompt at a time (no padding effects). Cost counts every
    beam's tokens: BEAMS rows decode in each step."""
    policy = getattr(engine.model, "policy", engine.model)
    texts, tokens = [], 0
    for ids in prompts:
        input_ids = torch.tensor([ids], device=engine.device)
        out = policy.generate(input_ids, attention_mask=torch.ones_like(input_ids), num_beams=BEAMS, do_sample=False,
                              max_new_tokens=max_new_tokens, pad_token_id=engine.pad_id,
                              eos_token_id=sorted(engine.eos_ids) or None)
        response = out[0, len(ids):].tolist()
        tokens += BEAMS * max(len(response), 1)
        texts.append(engine.tokenizer.decode([t for t in response if t not in engine.eos_ids and t != engine.pad_id],
                                             skip_special_tokens=True))
    return texts, tokens


def win_rate(scores: list[float], baseline: list[float], tolerance: float = 1e-6) -> dict:
    """Table 1's columns: win / tie / loss percentages and win rate = (wins + ties / 2) / n."""
    wins = ties = losses = 0
    for s, b in zip(scores, baseline, strict=True):
        if abs(s - b) <= tolerance * max(1.0, abs(b)):
            ties += 1
        elif s > b:
            wins += 1
        else:
            losses += 1
    n = max(len(scores), 1)
    return {"win": wins / n, "tie": ties / n, "loss": losses / n, "win_rate": (wins + ties / 2) / n}


def summarize(run: MethodRun, baseline: MethodRun) -> dict:
    """One row of the report: ``run`` (judged) against ``baseline`` (judged, usually greedy)."""
    return {
        **win_rate(run.scores, baseline.scores),
        "mean_score": sum(run.scores) / len(run.scores),
        "token_cost_vs_greedy": run.generated_tokens / max(baseline.generated_tokens, 1),
        "time_cost_vs_greedy": run.wall_seconds / max(baseline.wall_seconds, 1e-9),
        "forward_pass_cost_vs_greedy": (None if run.forward_passes is None or not baseline.forward_passes
                                        else run.forward_passes / baseline.forward_passes),
        "generated_tokens": run.generated_tokens,
    }


def judged(method: str, engine, scorer, prompts: list[PromptInput], max_new_tokens: int, seed: int = 0,
           **kwargs) -> MethodRun:
    """``decode`` plus the judge's score of every response."""
    run = decode(method, engine, scorer, prompts, max_new_tokens, seed, **kwargs)
    run.scores = scorer.score([p.reward_input for p in prompts], run.texts)
    return run


def compare(engine, scorer, prompts: list[PromptInput], methods: list[str], max_new_tokens: int, seed: int = 0,
            **kwargs) -> dict:
    """Run greedy (the baseline) and ``methods``, judge every response with ``scorer``, and
    report each method's win rate and cost relative to greedy."""
    baseline = judged("greedy", engine, scorer, prompts, max_new_tokens, seed, **kwargs)
    return {m: summarize(baseline if m == "greedy" else judged(m, engine, scorer, prompts, max_new_tokens, seed,
                                                                **kwargs), baseline)
            for m in methods}


def format_report(report: dict) -> str:
    lines = [f"{'method':<12} {'win':>6} {'tie':>6} {'loss':>6} {'win rate':>9} {'tokens x':>9} {'passes x':>9} "
             f"{'time x':>7}"]
    for name, r in report.items():
        passes = r["forward_pass_cost_vs_greedy"]
        lines.append(f"{name:<12} {r['win']:>6.1%} {r['tie']:>6.1%} {r['loss']:>6.1%} {r['win_rate']:>9.1%} "
                     f"{r['token_cost_vs_greedy']:>9.2f} {'-' if passes is None else f'{passes:.2f}':>9} "
                     f"{r['time_cost_vs_greedy']:>7.2f}")
    return "\n".join(lines)
