"""Counterfactual analysis of speculative rejection (paper section 6.2, appendices D and E).

    bon-counterfactual --generator DIR --reward SPEC [SPEC ...] [--reward-weights W ...] \
        --prompts FILE.jsonl --num-samples 100 [--taus 8 16 32 64] [--alphas 0.5 0.7 0.8 0.9 0.95] \
        [--max-new-tokens 128] [--weight-grid W,W ...] [--standardize] [--output DIR]
    (or python -m jobs.counterfactual ...)

For each prompt it samples N full completions (Best-of-N) and scores every one at each decision
token tau (streaming reward sessions, so each tau costs only the new chunk) and at the end, under
each reward of --reward (reward model directories or ``module:function`` reward functions, as
``models.reward`` takes them; a function gets the prompt file's other columns, e.g. IFEval's
instruction_id_list and kwargs for ``pipeline.judge:ifeval_reward``, and ``partial``). Then, on
those same completions, it replays Algorithm 1 over the alpha x tau grid, on the rewards combined
as a build combines them (pipeline.engines.rewards.combine: sum_k w_k r_k with --reward-weights):
the token rate and the normalized score of Eq. 6 (pipeline.decoding.metrics), and per prompt the
Pearson and Kendall correlations of partial vs final reward. Where the prompts carry IFEval's
columns, each cell also has the external judge's verdict on the completion it chooses (IFEval strict,
pipeline.judge: prompt- and instruction-level accuracy), beside Best-of-N's choice and a random
sample's (completion 0).

--weight-grid replays the same completions under other weightings (one comma-separated weight per
reward each), and --standardize also under each weighting standardized per prompt (each reward's
partial rewards at tau, and its final rewards, z-scored across the prompt's completions before the
weighted sum): the comparison behind a build's raw sum (docs/design.md, "Composite rewards").

Writes DIR/counterfactual.json (the settings under the flags' names, the grid, the correlations,
every prompt's id, its tokens as the models read them (``prompt_tokens``: the generator's prefill, the
prompt through its chat template; ``reward_prompt_tokens``: the reward models' text before the
response, pipeline.data.chat.reward_prompt_tokens, summed over them, a reward function reading none)
and its completions' rewards under each reward, and ``combinations``: each weighting's grid;
benchmarks.frontier replays it, and pools collections of the same prompts under other --seed),
DIR/summary.json (the same without the per-prompt data: ``report_summary``; what
benchmarks/results keeps),
DIR/tradeoff.png (score and token rate against alpha, one line per tau, as the paper's Figure 3)
and DIR/correlations.png (per-prompt Pearson and Kendall histograms, as Figure 5).
Bad input (missing file, no usable prompt, a bad weight) prints one line and exits with code 2.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from jobs.cli import add_device_flags, bars, exits_on_interrupt, job_parser, setup_logging
from pipeline.decoding.metrics import PromptRewards, accepted, chosen, correlations, grid

log = logging.getLogger(__name__)


@dataclass
class Collected:
    """One prompt's N completions: under each reward, the partial rewards at each tau and the finals."""

    lengths: list[int]
    final: list[list[float]]
    """Per reward, each completion's final reward."""
    partial: dict[int, list[list[float]]]
    """tau -> per reward, each completion's reward at tau (its final one if it ended before tau)."""
    ended: dict[int, list[bool]]
    """tau -> whether each completion had ended by tau (scored as a final response there)."""
    judged: list[list[bool]] | None = None
    """IFEval's per-instruction verdict on each final completion (None: the prompt has no instructions)."""

    def rewards(self, weights: list[float], standardize: bool = False) -> PromptRewards:
        """The prompt's rewards combined as a build combines them (``combine``), or standardized per
        prompt first (each reward's values z-scored across the completions)."""
        def scaled(parts: list[list[float]]) -> list[list[float]]:
            return [zscore(p) for p in parts] if standardize else parts

        n = len(self.lengths)
        from pipeline.engines.rewards import combine

        return PromptRewards(lengths=self.lengths, final=combine(scaled(self.final), weights, None, [0] * n),
                             partial={tau: combine(scaled(parts), weights, self.ended[tau], [0] * n)
                                      for tau, parts in self.partial.items()})


def zscore(values: list[float]) -> list[float]:
    """Each finite value's z-score among the finite values (0 for all when they are equal); NaN stays."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return list(values)
    mean = sum(finite) / len(finite)
    sd = math.sqrt(sum((v - mean) ** 2 for v in finite) / len(finite))
    return [((v - mean) / sd if sd > 0 else 0.0) if math.isfinite(v) else v for v in values]


def collect(engine, scorers: list, prompts, n: int, taus: list[int], sampling, seed: int, progress=True) -> list[Collected]:
    """N completions per prompt with each reward's partial rewards at each tau (no row is stopped).
    ``progress``: a bar; without one, a log line per prompt (INFO; DEBUG beside the bar)."""
    from tqdm import tqdm

    from pipeline.decoding.sampling import row_seed
    from pipeline.judge import check

    out = []
    for done, p in enumerate(tqdm(prompts, desc="counterfactual", disable=not progress), 1):
        session, rewards = uuid.uuid4().hex, uuid.uuid4().hex
        engine.open(session, [p.token_ids], n, [row_seed(seed, p.prompt_id, s) for s in range(n)], sampling)
        opened = []
        partial: dict[int, list[dict[int, float]]] = {}
        ended: dict[int, dict[int, bool]] = {}
        try:
            for scorer in scorers:
                scorer.open(rewards, [p.reward_input], n, columns=[p.columns])
                opened.append(scorer)

            def score(rows) -> list[dict[int, float]]:
                ids, texts, finished = [r.row for r in rows], [r.text for r in rows], [r.finished for r in rows]
                return [dict(zip(ids, s.extend(rewards, ids, texts, finished=finished))) for s in scorers]

            for tau in taus:
                rows = engine.extend(session, until=tau)
                # Finished rows stay listed so their (final) reward is read once and then reused.
                partial[tau], ended[tau] = score(rows), {r.row: r.finished for r in rows}
            rows = engine.extend(session, until=sampling.max_new_tokens)
            final = score(rows)
        finally:
            engine.close(session)
            for scorer in opened:
                scorer.close(rewards)
        order = [r.row for r in rows]
        instructions = p.columns.get("instruction_id_list"), p.columns.get("kwargs")
        judged = None
        if instructions[0] is not None and instructions[1] is not None:
            judged = [check(r.text, instructions[0], instructions[1], p.raw_prompt if isinstance(p.raw_prompt, str)
                            else None) for r in rows]
        out.append(Collected(lengths=[len(r.token_ids) for r in rows], final=[[f[k] for k in order] for f in final],
                             partial={tau: [[v[k] for k in order] for v in partial[tau]] for tau in taus},
                             ended={tau: [ended[tau][k] for k in order] for tau in taus}, judged=judged))
        log.log(logging.DEBUG if progress else logging.INFO, "counterfactual: prompt %d/%d, %d completions",
                done, len(prompts), n)
    return out


def judge_grid(collected: list[Collected], combined: list[PromptRewards], taus: list[int], alphas: list[float],
               keep_lowest: bool = True) -> dict | None:
    """The judge's verdict on the completion each cell chooses (IFEval strict accuracy, prompt- and
    instruction-level), on Best-of-N's choice, and on completion 0 (a random sample: its seed is
    one of N alike); None when no prompt has IFEval's columns."""
    from pipeline.judge import accuracy

    judged = [(c, p) for c, p in zip(collected, combined) if c.judged is not None]
    if not judged:
        return None

    def verdict(pick) -> dict:
        picks = [(c, pick(p)) for c, p in judged]
        return {k: round(v, 4) for k, v in accuracy([c.judged[k] for c, k in picks if k is not None]).items()}

    return {"prompts": len(judged),
            "best_of_n": verdict(lambda p: chosen(p, set(range(len(p.lengths))))),
            "random_sample": verdict(lambda p: 0),
            "grid": [{"tau": tau, "alpha": alpha,
                      **verdict(lambda p: chosen(p, accepted(p, tau, alpha, keep_lowest)))}
                     for tau in taus for alpha in alphas]}


def summarize(collected: list[PromptRewards], taus: list[int], alphas: list[float], keep_lowest: bool = True) -> dict:
    per_prompt = []
    for p in collected:
        per_prompt.append({str(tau): dict(zip(("pearson", "kendall"), correlations(p, tau))) for tau in taus})
    mean = {}
    for tau in taus:
        for key in ("pearson", "kendall"):
            values = [c[str(tau)][key] for c in per_prompt if math.isfinite(c[str(tau)][key])]
            mean[f"{key}@{tau}"] = sum(values) / len(values) if values else math.nan
    return {"grid": grid(collected, taus, alphas, keep_lowest), "correlations": per_prompt,
            "mean_correlations": mean, "keep_lowest": keep_lowest}


def plot(summary: dict, taus: list[int], alphas: list[float], output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for tau in taus:
        cells = [g for g in summary["grid"] if g["tau"] == tau]
        left.plot(alphas, [g["score"] for g in cells], marker="o", label=f"tau={tau}")
        right.plot(alphas, [g["token_rate"] for g in cells], marker="o", label=f"tau={tau}")
    left.set(xlabel="rejection rate alpha", ylabel="normalized score (Eq. 6)")
    right.set(xlabel="rejection rate alpha", ylabel="token rate")
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(output / "tradeoff.png", dpi=150)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key in zip(axes, ("pearson", "kendall")):
        for tau in taus:
            values = [c[str(tau)][key] for c in summary["correlations"] if math.isfinite(c[str(tau)][key])]
            ax.hist(values, bins=20, range=(-1, 1), alpha=0.5, label=f"tau={tau}")
        ax.set(xlabel=f"{key} correlation, partial vs final reward", ylabel="prompts")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(output / "correlations.png", dpi=150)


def report_lines(summary: dict, taus: list[int], alphas: list[float]) -> None:
    """Per tau: the mean correlations, and per alpha the normalized score / token rate (and the
    judge's prompt-level accuracy of the choice, where there is a judge)."""
    judge = summary.get("judge")
    verdicts = {(g["tau"], g["alpha"]): g for g in judge["grid"]} if judge else {}
    for tau in taus:
        cells = {g["alpha"]: g for g in summary["grid"] if g["tau"] == tau}
        line = "  ".join(f"a={a}: {cells[a]['score']:.1f}/{cells[a]['token_rate']:.2f}"
                         + (f"/{100 * verdicts[tau, a]['prompt_level_strict']:.1f}" if verdicts else "") for a in alphas)
        m = summary["mean_correlations"]
        print(f"tau={tau:<4} pearson {m[f'pearson@{tau}']:.2f} kendall {m[f'kendall@{tau}']:.2f} | score/token rate"
              f"{'/IFEval prompt-level' if verdicts else ''}: {line}")
    if judge:
        print(f"IFEval (strict) on {judge['prompts']} prompts: Best-of-N's choice prompt-level "
              f"{100 * judge['best_of_n']['prompt_level_strict']:.1f}, instruction-level "
              f"{100 * judge['best_of_n']['instruction_level_strict']:.1f}; a random sample "
              f"{100 * judge['random_sample']['prompt_level_strict']:.1f} / "
              f"{100 * judge['random_sample']['instruction_level_strict']:.1f}")


@exits_on_interrupt()
def main(argv: list[str] | None = None) -> int:
    parser = job_parser("bon-counterfactual", __doc__)
    parser.add_argument("--generator", required=True, help="generator: HF model directory or hub id")
    parser.add_argument("--reward", required=True, nargs="+",
                        help="the reward(s), as models.reward takes them: a reward model (sequence classifier, one "
                             "label) or a reward function module:function; several: a composite reward")
    parser.add_argument("--reward-weights", type=float, nargs="+", default=None,
                        help="one weight per --reward (models.reward_weights; default 1 each): the grid's rewards")
    parser.add_argument("--weight-grid", nargs="+", default=[],
                        help="more weightings to replay on the same completions, each W,W,... (one per reward)")
    parser.add_argument("--standardize", action="store_true",
                        help="also replay each weighting on rewards z-scored per prompt across its completions")
    parser.add_argument("--prompts", required=True, help="JSONL or Parquet with a prompt column (local or s3://)")
    parser.add_argument("--prompt-column", default="prompt", help="the column of --prompts that holds the prompt")
    parser.add_argument("--num-samples", type=int, default=100, help="N: completions per prompt (>= 2)")
    parser.add_argument("--num-prompts", type=int, default=100, help="use the first this many prompts")
    parser.add_argument("--taus", type=int, nargs="+", default=[8, 16, 32, 64],
                        help="decision tokens: the partial rewards are read after this many tokens")
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.5, 0.6, 0.7, 0.8, 0.9, 0.95],
                        help="rejection rates of the replayed grid, each in [0, 1)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="token cap of each completion")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1: off)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the per-row sampling seeds")
    add_device_flags(parser)
    parser.add_argument("--output", default="out/counterfactual", help="directory for the JSON and the plots")
    parser.add_argument("--no-keep-lowest", dest="keep_lowest", action="store_false",
                        help="replay without strategy.keep_lowest (the paper's Algorithm 1 exactly)")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    if args.num_samples < 2 or any(t < 1 for t in args.taus) or any(not 0 <= a < 1 for a in args.alphas):
        log.error("need --num-samples >= 2, taus >= 1 and alphas in [0, 1)")
        return 2
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:  # checked before hours of sampling, not after
        log.error("the trade-off plots need matplotlib: pip install 'bon-pipeline[plots]'")
        return 2

    weights = args.reward_weights or [1.0] * len(args.reward)
    try:
        weightings = [weights] + [[float(w) for w in spec.split(",")] for spec in args.weight_grid]
    except ValueError as exc:
        log.error("--weight-grid: %s (expected W,W,... numbers)", exc)
        return 2
    wrong = [w for w in weightings if len(w) != len(args.reward) or not all(map(math.isfinite, w))]
    if wrong:
        log.error("--reward-weights / --weight-grid: %s: expected %d finite weights, one per --reward",
                  ",".join(map(str, wrong[0])), len(args.reward))
        return 2

    from pipeline.data.chat import PromptFormatter, prompt_id, reward_prompt_tokens
    from pipeline.data.prompts import read_prompt_file
    from pipeline.errors import InputError
    from pipeline.decoding.domain import PromptInput
    from pipeline.decoding.sampling import SamplingParams
    from pipeline.engines.hf import HFEngine
    from pipeline.engines.rewards import RewardScorer, is_reward_function, load_rewards

    try:
        rows, _rejects = read_prompt_file(args.prompts, args.prompt_column)
    except InputError as exc:
        log.error("%s", exc)
        return 2
    if not rows:
        log.error("%s: no usable prompt in column %r", args.prompts, args.prompt_column)
        return 2
    try:
        scorers = [load_rewards([spec], None, lambda m: RewardScorer.from_pretrained(m, device=args.device,
                                                                                     dtype=args.dtype))
                   for spec in args.reward]
    except ValueError as exc:
        log.error("--reward: %s", exc)
        return 2
    engine = HFEngine.from_pretrained(args.generator, device=args.device, dtype=args.dtype)
    formatter = PromptFormatter(engine.tokenizer, max(1, engine.max_context - args.max_new_tokens))
    prompts = []
    for row in rows[:args.num_prompts]:
        text, ids = formatter.render(row.prompt)
        prompts.append(PromptInput(prompt_id(row.prompt), text, row.prompt, ids, columns=row.columns))
    taus = sorted({t for t in args.taus if t < args.max_new_tokens})
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p)
    collected = collect(engine, scorers, prompts, args.num_samples, taus, sampling, args.seed, bars(args))
    combinations, main_rewards = [], None
    for w in weightings:
        for standardize in ([False, True] if args.standardize else [False]):
            combined = [c.rewards(w, standardize) for c in collected]
            main_rewards = main_rewards or combined  # the first: --reward-weights, raw
            combinations.append({"weights": w, "standardized": standardize,
                                 **summarize(combined, taus, args.alphas, args.keep_lowest),
                                 "judge": judge_grid(collected, combined, taus, args.alphas, args.keep_lowest)})
    summary = combinations[0]
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    report = {"generator": args.generator, "reward": args.reward if len(args.reward) > 1 else args.reward[0],
              "reward_weights": weights, "prompts": len(prompts),
              "num_samples": args.num_samples, "taus": taus, "alphas": args.alphas,
              "max_new_tokens": args.max_new_tokens, "seed": args.seed,
              "streaming_reward": any(getattr(s, "streaming", False) for s in scorers),
              "reward_tokens_read": sum(int(s.stats().get("tokens_read", 0)) for s in scorers),
              **{k: v for k, v in summary.items() if k not in ("weights", "standardized")},
              "combinations": combinations,
              "completions": [{"prompt_id": prompt.prompt_id, "prompt_tokens": len(prompt.token_ids),
                               "reward_prompt_tokens": sum(reward_prompt_tokens(s.tokenizer, prompt.reward_input)
                                                           for s in scorers if hasattr(s, "tokenizer")),
                               "lengths": p.lengths, "final": p.final,
                               "partial": {str(t): v for t, v in p.partial.items()},
                               "rewards": {spec: {"final": c.final[k], "partial": {str(t): c.partial[t][k] for t in taus}}
                                           for k, spec in enumerate(args.reward)},
                               "ended": {str(t): v for t, v in c.ended.items()}, "judged": c.judged}
                              for prompt, p, c in zip(prompts, main_rewards, collected)]}
    (output / "counterfactual.json").write_text(json.dumps(report, indent=1))
    (output / "summary.json").write_text(json.dumps(report_summary(report), indent=1))
    plot(summary, taus, args.alphas, output)
    for combination in combinations:
        if len(combinations) > 1:
            print(f"weights {combination['weights']}{' standardized per prompt' if combination['standardized'] else ''}:")
        report_lines(combination, taus, args.alphas)
    print(f"output: {output}/counterfactual.json, summary.json, tradeoff.png, correlations.png")
    return 0


def report_summary(report: dict) -> dict:
    """The report without its per-prompt data (every completion's rewards, each prompt's
    correlations): the settings, each weighting's grid, mean correlations and judge verdicts, and
    per reward the spread of its final rewards within a prompt (medians over the prompts: distinct
    values, the share of completions at the prompt's top value, range, standard deviation). It is
    what a results folder keeps; counterfactual.json, beside it, holds every number."""
    def brief(part: dict) -> dict:
        return {k: v for k, v in part.items() if k not in ("correlations", "completions", "combinations")}

    specs = report["reward"] if isinstance(report["reward"], list) else [report["reward"]]
    spread = {}
    for spec in specs:
        finals = [c["rewards"][spec]["final"] for c in report["completions"]]
        spread[spec] = {"median_distinct": statistics.median(len(set(f)) for f in finals),
                        "median_top_share": statistics.median(f.count(max(f)) / len(f) for f in finals),
                        "median_range": statistics.median(max(f) - min(f) for f in finals),
                        "median_std": statistics.median(statistics.pstdev(f) for f in finals)}
    return {**brief(report), "combinations": [brief(c) for c in report["combinations"]], "final_reward_spread": spread}


if __name__ == "__main__":
    sys.exit(main())
