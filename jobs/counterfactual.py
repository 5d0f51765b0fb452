"""Counterfactual analysis of speculative rejection (paper section 6.2, appendices D and E).

    bon-counterfactual --generator DIR --reward DIR --prompts FILE.jsonl --num-samples 100 \\
        [--taus 8 16 32 64] [--alphas 0.5 0.7 0.8 0.9 0.95] [--max-new-tokens 128] [--output DIR]
    (or python -m jobs.counterfactual ...)

For each prompt it samples N full completions (Best-of-N) and scores every one at each decision
token tau (streaming reward sessions, so each tau costs only the new chunk) and at the end. Then,
on those same completions, it replays Algorithm 1 over the alpha x tau grid: the token rate and
the normalized score of Eq. 6 (pipeline.decoding.metrics), and per prompt the Pearson and
Kendall correlations of partial vs final reward. Writes DIR/counterfactual.json (the settings
under the flags' names, the grid, the correlations and every completion's rewards),
DIR/tradeoff.png (score and token rate against alpha, one line per tau, as the paper's Figure 3)
and DIR/correlations.png (per-prompt Pearson and Kendall histograms, as Figure 5).
Bad input (missing file, no usable prompt) prints one line and exits with code 2.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import uuid
from pathlib import Path

from jobs.cli import add_device_flags, bars, job_parser, setup_logging
from pipeline.decoding.metrics import PromptRewards, correlations, grid

log = logging.getLogger(__name__)


def collect(engine, scorer, prompts, n: int, taus: list[int], sampling, seed: int, progress=True) -> list[PromptRewards]:
    """N completions per prompt with partial rewards at each tau (no row is stopped). ``progress``:
    a bar; without one, a log line per prompt (INFO; DEBUG beside the bar)."""
    from tqdm import tqdm

    from pipeline.decoding.sampling import row_seed

    out = []
    for done, p in enumerate(tqdm(prompts, desc="counterfactual", disable=not progress), 1):
        session, rewards = uuid.uuid4().hex, uuid.uuid4().hex
        engine.open(session, [p.token_ids], n, [row_seed(seed, p.prompt_id, s) for s in range(n)], sampling)
        scorer.open(rewards, [p.reward_input], n)
        partial: dict[int, dict[int, float]] = {}
        try:
            for tau in taus:
                rows = engine.extend(session, until=tau)
                # Finished rows stay listed so their (final) reward is read once and then reused.
                partial[tau] = dict(zip([r.row for r in rows], scorer.extend(rewards, [r.row for r in rows],
                                                                             [r.text for r in rows])))
            rows = engine.extend(session, until=sampling.max_new_tokens)
            final = scorer.extend(rewards, [r.row for r in rows], [r.text for r in rows])
        finally:
            engine.close(session)
            scorer.close(rewards)
        out.append(PromptRewards(lengths=[len(r.token_ids) for r in rows], final=final,
                                 partial={tau: [partial[tau][r.row] for r in rows] for tau in taus}))
        log.log(logging.DEBUG if progress else logging.INFO, "counterfactual: prompt %d/%d, %d completions",
                done, len(prompts), n)
    return out


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


def main(argv: list[str] | None = None) -> int:
    parser = job_parser("bon-counterfactual", __doc__)
    parser.add_argument("--generator", required=True, help="generator: HF model directory or hub id")
    parser.add_argument("--reward", required=True, help="reward model (sequence classifier, one label)")
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

    from pipeline.data.prompts import PromptFormatter, prompt_id, read_raw_rows, validate
    from pipeline.errors import InputError
    from pipeline.decoding.domain import PromptInput
    from pipeline.decoding.sampling import SamplingParams
    from pipeline.engines.hf import HFEngine
    from pipeline.engines.rewards import RewardScorer

    try:
        rows, _rejects = validate(read_raw_rows(args.prompts, args.prompt_column), args.prompt_column)
    except InputError as exc:
        log.error("%s", exc)
        return 2
    if not rows:
        log.error("%s: no usable prompt in column %r", args.prompts, args.prompt_column)
        return 2
    engine = HFEngine.from_pretrained(args.generator, device=args.device, dtype=args.dtype)
    scorer = RewardScorer.from_pretrained(args.reward, device=args.device, dtype=args.dtype)
    formatter = PromptFormatter(engine.tokenizer, max(1, engine.max_context - args.max_new_tokens))
    prompts = []
    for row in rows[:args.num_prompts]:
        text, ids = formatter.render(row.prompt)
        prompts.append(PromptInput(prompt_id(row.prompt), text, row.prompt, ids))
    taus = sorted({t for t in args.taus if t < args.max_new_tokens})
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p)
    collected = collect(engine, scorer, prompts, args.num_samples, taus, sampling, args.seed,
                        bars(args))
    summary = summarize(collected, taus, args.alphas, args.keep_lowest)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    report = {"generator": args.generator, "reward": args.reward, "prompts": len(prompts),
              "num_samples": args.num_samples, "taus": taus, "alphas": args.alphas,
              "max_new_tokens": args.max_new_tokens, "seed": args.seed,
              "streaming_reward": scorer.streaming, "reward_tokens_read": scorer.tokens_read, **summary,
              "completions": [{"lengths": p.lengths, "final": p.final, "partial": {str(t): v for t, v in p.partial.items()}}
                              for p in collected]}
    (output / "counterfactual.json").write_text(json.dumps(report, indent=1))
    plot(summary, taus, args.alphas, output)
    for tau in taus:
        cells = {g["alpha"]: g for g in summary["grid"] if g["tau"] == tau}
        line = "  ".join(f"a={a}: {cells[a]['score']:.1f}/{cells[a]['token_rate']:.2f}" for a in args.alphas)
        m = summary["mean_correlations"]
        print(f"tau={tau:<4} pearson {m[f'pearson@{tau}']:.2f} kendall {m[f'kendall@{tau}']:.2f} | score/token rate: {line}")
    print(f"output: {output}/counterfactual.json, tradeoff.png, correlations.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
