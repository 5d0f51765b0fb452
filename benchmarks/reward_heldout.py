"""Reward models side by side on one set of judged held-out responses.

    python -m benchmarks.reward_heldout --data out/rm8/reward-data --reward .cache/real-models/reward
        [OTHER_REWARD_DIR ...] [--channel RT_DIR ...] [--checker [--composite-weight W [W ...]]]
        [--taus 16 32 64 128] [--tokenizer DIR] [--json FILE]

``--data`` is a reward-model build's DIR/reward-data (``python -m jobs.fetch_models``, steps 4-5):
its samples-eval.jsonl (responses sampled for the held-out prompts) and judged-eval.jsonl (IFEval's
verdicts on them). Each reward model in ``--reward`` scores the same responses, so models trained on
different samples (the committed one and a retrained one) are compared on equal terms. Per reward it
prints, with pipeline.training.reward_evaluation's functions (the ones a build's report uses):

- agreement: the share of the judge's pairs (two responses of one prompt whose instruction-level
  verdicts differ) that the final reward orders the same way;
- partial-vs-final Kendall's tau at each tau, per prompt (averaged over prompts with three or more
  responses longer than tau, the speculative-rejection paper's appendix D statistic) and pooled;
- prefix agreement at each tau: the share of the judge's pairs, both responses longer than tau,
  that the partial reward at tau already orders as the judge's final verdict does. This is what a
  speculative-rejection cut at tau needs.

``--channel`` scores the same responses with Reward Transformers' reward channels
(bon-train-reward-transformer): the final reward is R' at a response's last token and the partial
reward at tau is R' after its first tau tokens, read on the prompt token ids the responses were
sampled after, as a decoding pass reads it (what ``strategy.partial_reward: generator`` cuts on).

``--checker`` adds IFEval's checkers as a reward (pipeline.judge:ifeval_reward; a prefix scores 1
minus the share of its instructions already broken). The held-out prompt file named in DATA's
settings.json gives each prompt's instructions. Its final reward is the judge's own verdict (its
agreement is 1 by construction). Its prefix figures measure how much of the verdict 64 tokens
already settle. With ``--composite-weight W`` each reward model is also scored as the composite
a build sums (models.reward [checker, model], models.reward_weights [1, W]: raw, as TRL sums).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks import bench_parser, fail, parse, write_json


def held_out(data: Path):
    """The held-out samples of a reward-data directory and their instruction-level judge fractions."""
    from pipeline.errors import InputError
    from pipeline.training.judged_samples import read_judged

    try:
        return read_judged(data, "eval")
    except InputError as exc:
        fail(str(exc))


def figures(samples: list, fractions: list[float], final: list[float], partial: dict[int, dict[int, float]]) -> dict:
    """Agreement, partial-vs-final correlations and prefix agreement of one reward (module docstring)."""
    from pipeline.training.judged_samples import preference_pairs
    from pipeline.training.reward_evaluation import pairwise_agreement, partial_final_correlations

    pairs = preference_pairs([s.prompt_id for s in samples], fractions, 0.0)
    prefix = {}
    for tau, scores in partial.items():
        both = [(c, r) for c, r in pairs if c in scores and r in scores]
        agreement = pairwise_agreement([scores.get(i, math.nan) for i in range(len(samples))], both)
        prefix[str(tau)] = {"pairs": len(both), "agreement": None if math.isnan(agreement) else round(agreement, 4)}
    return {"pairs": len(pairs), "agreement": round(pairwise_agreement(final, pairs), 4),
            "partial_final_correlation": partial_final_correlations(samples, final, partial),
            "prefix_agreement": prefix}


def checker_rewards(samples: list, instructions: dict, taus: list[int], tokenizer):
    """IFEval's checkers as a reward: final scores and {tau: {sample index: prefix score}}."""
    from pipeline.judge import ifeval_reward

    def score(index: list[int], texts: list[str], partial: bool) -> list[float]:
        ids, kwargs = zip(*[instructions[samples[i].prompt_id] for i in index])
        return ifeval_reward([samples[i].prompt for i in index], texts, ids, kwargs, partial=[partial] * len(index))

    final = score(list(range(len(samples))), [s.text for s in samples], False)
    partial = {}
    for tau in taus:
        live = [i for i, s in enumerate(samples) if len(s.token_ids) > tau]
        texts = tokenizer.batch_decode([samples[i].token_ids[:tau] for i in live], skip_special_tokens=True)
        partial[tau] = dict(zip(live, score(live, texts, True))) if live else {}
    return final, partial


def channel_rewards(path: str, data: Path, samples: list, taus: list[int]):
    """A Reward Transformer's channel as a reward of the held-out samples (module docstring):
    final scores and {tau: {sample index: partial score}}."""
    from pipeline.engines.hf import load_tokenizer
    from pipeline.engines.reward_transformer import RewardTransformer, has_trained_channel
    from pipeline.errors import FetchError, InputError
    from pipeline.training.cached_steps import prompt_token_ids
    from pipeline.training.reward_channel import channel_scores

    if not has_trained_channel(path):
        fail(f"--channel: {path} has no trained reward channel (bon-train-reward-transformer makes one)")
    tokenizer = load_tokenizer(path)
    try:
        prompts = prompt_token_ids(data, "eval", tokenizer, {s.prompt_id for s in samples})
    except (FetchError, InputError) as exc:
        fail(str(exc).splitlines()[0])
    model = RewardTransformer.from_pretrained(path)
    return channel_scores(model, [(prompts[s.prompt_id], list(s.token_ids)) for s in samples], taus,
                          int(tokenizer.pad_token_id))


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__name__, __doc__, json=None)
    parser.add_argument("--data", required=True, help="a reward model build's DIR/reward-data (held-out samples, judged)")
    parser.add_argument("--reward", nargs="*", default=[], help="reward model directories to compare")
    parser.add_argument("--channel", nargs="*", default=[],
                        help="Reward Transformer directories whose trained reward channel to compare")
    parser.add_argument("--checker", action="store_true", help="also IFEval's checkers as a reward")
    parser.add_argument("--composite-weight", type=float, nargs="+", default=None,
                        help="with --checker: also the checker + W x each reward model, summed raw (one W for "
                             "all, or one per --reward)")
    parser.add_argument("--taus", type=int, nargs="+", default=[16, 32, 64, 128], help="decision tokens")
    parser.add_argument("--tokenizer", default=None,
                        help="the generator's tokenizer, to cut responses for --checker (default: the first --reward)")
    args = parse(parser, argv)
    if not args.reward and not args.checker and not args.channel:
        fail("nothing to compare: give --reward DIR ..., --channel DIR ... and/or --checker")
    if args.composite_weight is not None and not (args.checker and args.reward):
        fail("--composite-weight needs --checker and --reward DIR")
    if args.composite_weight is not None and len(args.composite_weight) not in (1, len(args.reward)):
        fail(f"--composite-weight: one weight, or one per --reward ({len(args.reward)}), got "
             f"{len(args.composite_weight)}")
    for path in args.reward:
        if not (Path(path) / "config.json").exists():
            fail(f"--reward: {path}/config.json: no such file")
    data = Path(args.data)
    samples, fractions = held_out(data)
    from pipeline.engines.rewards import RewardScorer
    from pipeline.training.reward_evaluation import partial_rewards

    results, scores = {}, {}
    for path in args.reward:
        scorer = RewardScorer.from_pretrained(path)
        final = scorer.score([s.prompt for s in samples], [s.text for s in samples])
        scores[path] = final, partial_rewards(scorer, samples, args.taus, scorer.tokenizer)
        results[path] = figures(samples, fractions, *scores[path])
    for path in args.channel:
        results[f"channel {path}"] = figures(samples, fractions, *channel_rewards(path, data, samples, args.taus))
    if args.checker:
        from pipeline.engines.hf import load_tokenizer
        from pipeline.errors import FetchError, InputError
        from pipeline.training.cached_steps import load_instructions

        source = args.tokenizer or (args.reward + args.channel or [None])[0]
        if source is None:
            fail("--checker needs --tokenizer DIR (the generator's) when no --reward is given")
        settings = data / "settings.json"
        if not settings.exists():
            fail(f"{settings}: no such file (it names the held-out prompt file)")
        prompts = json.loads(settings.read_text())["eval_prompts"]
        try:
            instructions = load_instructions(prompts)
        except (FetchError, InputError) as exc:
            fail(str(exc).splitlines()[0])
        missing = {s.prompt_id for s in samples} - set(instructions)
        if missing:
            fail(f"{prompts}: {len(missing)} sampled prompts are not in the file")
        final, partial = checker_rewards(samples, instructions, args.taus, load_tokenizer(source))
        results["pipeline.judge:ifeval_reward"] = figures(samples, fractions, final, partial)
        weights = args.composite_weight or []
        for w, (path, (model_final, model_partial)) in zip(weights * len(scores) if len(weights) == 1 else weights,
                                                           scores.items()):
            results[f"checker + {w:g} x {path}"] = figures(
                samples, fractions, [a + w * b for a, b in zip(final, model_final)],
                {tau: {i: v + w * model_partial[tau][i] for i, v in partial[tau].items()} for tau in partial})
    print(f"{len(samples)} held-out responses of {len({s.prompt_id for s in samples})} prompts ({data})")
    print(f"{'reward':<40} {'agree':>6}  per-prompt / pooled Kendall, prefix agreement at tau")
    for name, f in results.items():
        cells = []
        for tau in args.taus:
            c, p = f["partial_final_correlation"][str(tau)], f["prefix_agreement"][str(tau)]
            cells.append(f"{tau}: {_fmt(c['per_prompt_kendall'])}/{_fmt(c['kendall'])}, {_fmt(p['agreement'])}")
        print(f"{name[-40:]:<40} {f['agreement']:>6.3f}  " + "  ".join(cells))
    write_json(args.json, {"data": str(data), "responses": len(samples), "taus": args.taus, "rewards": results}, args)
    return 0


def _fmt(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2f}"


if __name__ == "__main__":
    raise SystemExit(main())
