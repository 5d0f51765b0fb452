"""Speculative rejection vs Best-of-N on the real models, end to end through the build job.

    python -m benchmarks.real_sbon [--config configs/real.yaml] [--device cpu|cuda] [--num-prompts 64]
        [--generator DIR] [--reward DIR] [--num-samples N] [--max-new-tokens T] [--decision-token TAU]
        [--rejection-rate ALPHA] [--seed 0] [--repeats 1] [--set KEY=VALUE ...] [--sbon-set KEY=VALUE ...]
        [--prompts FILE] [--output out/bench/real-sbon] [--no-judge] [--json FILE]

    # on a GPU:
    python -m benchmarks.real_sbon --device cuda --num-prompts 64 --json out/bench/real-sbon-cuda.json

Runs ``jobs.build_dataset.main`` twice, Best-of-N then speculative rejection (sbon), on
configs/real.yaml (SmolLM2-135M-Instruct generating, its reward model scoring; ``make real-models``
or ``python -m jobs.fetch_models``): same prompts (the first ``--num-prompts`` of the config's
data.prompts), same seed, same settings (the config's N = 32, 256 tokens, tau 96, alpha 0.85 unless
a flag says otherwise, plus every ``--set``). On a CUDA device with no ``--set
runtime.{generator,reward}.num_gpus=...`` both actors get num_gpus 0.5, so Ray hands them the GPU.
From each run's ``_report.json`` and pair Parquet it prints:

- run seconds of each build (first batch dispatched to last shard committed; startup left out),
  the run-time speedup (Best-of-N / sbon), generated tokens and the token rate (sbon / Best-of-N),
  and the efficiency (speedup x token rate), as benchmarks.efficiency does;
- the normalized score (Eq. 5 of the paper, pipeline.decoding.metrics.normalized_score),
  averaged over the prompts both builds paired: 100 * (1 - (max_k s(Z_k) - s(sbon chosen)) /
  (max_k s(Z_k) - min_k s(Z_k))). The pair Parquet carries Best-of-N's max and min directly: its
  chosen_score is the best finite reward of its N completed candidates and, with data.rejected =
  complete (the default), its rejected_score the lowest one (pipeline.data.pairs.select_pair; the
  only candidates it skips are ones whose text equals the chosen text, whose reward then equals
  the max). Every candidate's sampler is seeded from (seed, prompt, sample index)
  (pipeline.decoding.sampling.row_seed), so sbon samples the same candidates as Best-of-N and the
  score is at most 100, up to floating-point noise of batched forward passes; the checks below
  say how far that held (prompts where sbon's chosen reward exceeds Best-of-N's, and prompts
  where both chose the same sample index but got different text);
- the mean reward-model score of each build's chosen response, and the share of prompts where
  sbon chose the same sample as Best-of-N;
- the external judge's verdict: IFEval's verifiable-instruction checkers (lm-eval's
  instructions_registry, pipeline.judge; strict accuracy), read from each pair's
  instruction_id_list and kwargs columns (the prompt file's, kept in the output): prompt-level and
  instruction-level accuracy of each build's chosen and rejected responses, and pair accuracy (the
  share of the pairs the judge tells apart where it ranks chosen above rejected). A prompt either
  build left unpaired (e.g. a tie: every candidate scored alike, common under a checker reward) is
  out of the comparison; both counts are printed;
- the random-sample baseline: one response per prompt from the generator alone, sampled with the
  builds' sampling settings and the seed of candidate 0 (pipeline.decoding.sampling.row_seed), so
  it is one of the builds' own candidates, judged the same way, on all prompts and on the compared ones.

Targets (on configs/real.yaml's composite reward, 64 held-out prompts, N 32, T 256):
sbon >= 2.5x less run time than Best-of-N at normalized (combined) score >= 98; sbon's chosen
IFEval accuracy within 1 point of Best-of-N's; Best-of-N's chosen >= 20 instruction-level points
above a random sample; the judge tells apart >= 75% of the pairs and ranks chosen above rejected in
>= 90% of those. Earlier targets: 15 points, 2 points, 85%.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from benchmarks import bench_parser, fail, job_argv, parse, read_prompts, run_job, write_json
from benchmarks.efficiency import COMPARED, compare, print_runs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = bench_parser(
        "benchmarks.real_sbon", __doc__, config="configs/real.yaml",
        device=dict(default="cpu", help="models.device of both builds and the judge's device"),
        generator=dict(help="models.generator (default: the config's)"),
        reward=dict(help="models.reward, a model directory or a reward function module:function (default: the "
                         "config's)"),
        num_prompts=64,
        prompts=dict(help="JSONL prompts (default: the config's data.prompts); IFEval's instruction_id_list and "
                          "kwargs columns make the judge's figures"),
        num_samples=dict(help="N (default: the config's)"), max_new_tokens=dict(help="default: the config's"),
        seed=dict(help="default: the config's"), repeats=1,
        set=dict(default=[], help="passed to both builds, e.g. --set runtime.rows_in_flight=256"),
        output="out/bench/real-sbon", json=None)
    parser.add_argument("--decision-token", type=int, help="sbon's tau (default: the config's)")
    parser.add_argument("--rejection-rate", type=float, help="sbon's alpha (default: the config's)")
    parser.add_argument("--sbon-set", dest="sbon_sets", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to the sbon build only, e.g. the memory-budget mode: --sbon-set "
                             "strategy.initial_candidates=64 --sbon-set strategy.max_live_candidates=16")
    parser.add_argument("--no-judge", action="store_true", help="skip the IFEval figures and the random sample")
    return parse(parser, argv)


def settings(args: argparse.Namespace) -> tuple[list[str], dict]:
    """The --set overrides both builds share, and the effective settings (from the loaded config)."""
    from pipeline.coordinator import sampling_params
    from pipeline.config import load_config

    shared = [f"models.device={args.device}"]
    for flag, key in (("generator", "models.generator"), ("reward", "models.reward"),
                      ("num_samples", "sampling.num_samples"), ("max_new_tokens", "sampling.max_new_tokens"),
                      ("seed", "seed")):
        if getattr(args, flag) is not None:
            shared.append(f"{key}={getattr(args, flag)}")
            if flag == "reward":  # one reward instead of the config's: the config's weights are not its
                shared.append("models.reward_weights=null")
    if args.device.startswith("cuda"):
        for role in ("generator", "reward"):
            if not any(o.startswith(f"runtime.{role}.num_gpus=") for o in args.overrides):
                shared.append(f"runtime.{role}.num_gpus=0.5")
    shared += args.overrides
    sbon = load_config(args.config, shared + sbon_overrides(args), strategy="sbon")
    params = sbon.strategy.params
    return shared, {"config": args.config, "device": args.device, "generator": sbon.models.generator,
                    "reward": sbon.models.reward, "prompts_file": args.prompts or sbon.data.prompts,
                    "num_samples": sbon.sampling.num_samples, "max_new_tokens": sbon.sampling.max_new_tokens,
                    "sampling": sampling_params(sbon), "chat_template": sbon.sampling.chat_template,
                    "decision_token": params.decision_token, "rejection_rate": params.rejection_rate,
                    "seed": sbon.seed, "overrides": shared}


def sbon_overrides(args: argparse.Namespace) -> list[str]:
    out = []
    if args.decision_token is not None:
        out.append(f"strategy.decision_token={args.decision_token}")
    if args.rejection_rate is not None:
        out.append(f"strategy.rejection_rate={args.rejection_rate}")
    return out + args.sbon_sets


def build(strategy: str, args: argparse.Namespace, shared: list[str], prompts: Path) -> dict:
    """One build through the build job; its run report."""
    output = Path(args.output) / strategy
    overrides = shared + (sbon_overrides(args) if strategy == "sbon" else [])
    start = time.perf_counter()
    report = run_job(strategy, job_argv(args.config, strategy, prompts, output, overrides), output)
    print(f"   {strategy}: run {report['run_seconds']:.2f}s, startup {report['startup_seconds']:.1f}s, "
          f"{report['generated_tokens']} tokens (wall {time.perf_counter() - start:.1f}s)", flush=True)
    return report


def read_pairs(output: Path, allow_partial: bool = False) -> dict[str, dict]:
    """prompt_id -> pair row of one finished build: its committed part files, through the output
    store (IncompleteBuild if the build did not finish, unless ``allow_partial``: then the shards
    committed so far; a stray part file is never read)."""
    import pyarrow.parquet as pq

    from pipeline.data.store import OutputStore

    store = OutputStore(str(output))
    rows = {}
    for part in store.committed_parts(allow_partial):
        with store.fs.open(part, "rb") as f:
            for row in pq.read_table(f).to_pylist():
                rows[row["prompt_id"]] = row
    return rows


def quality(bon: dict[str, dict], sbon: dict[str, dict]) -> tuple[dict, list[str]]:
    """Normalized score and the consistency checks over the prompts both builds paired."""
    from pipeline.decoding.metrics import normalized_score

    common = [p for p in bon if p in sbon]
    scores, above, same_sample, same_sample_other_text = [], 0, 0, 0
    for p in common:
        b, s = bon[p], sbon[p]
        value = normalized_score([b["chosen_score"], b["rejected_score"]], s["chosen_score"])
        if math.isfinite(value):
            scores.append(value)
        above += s["chosen_score"] > b["chosen_score"] + 1e-4 * max(1.0, abs(b["chosen_score"]))
        if s["chosen_sample"] == b["chosen_sample"]:
            same_sample += 1
            same_sample_other_text += s["chosen"] != b["chosen"]
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    return {"paired_prompts": {"best_of_n": len(bon), "sbon": len(sbon), "both": len(common)},
            "normalized_score": round(mean(scores), 3), "normalized_score_prompts": len(scores),
            "normalized_score_min": round(min(scores), 3) if scores else math.nan,
            "prompts_at_100": sum(v >= 100 - 1e-9 for v in scores),
            "mean_chosen_reward": {"best_of_n": round(mean([bon[p]["chosen_score"] for p in common]), 4),
                                   "sbon": round(mean([sbon[p]["chosen_score"] for p in common]), 4)},
            "same_chosen_sample": same_sample, "same_sample_different_text": same_sample_other_text,
            "sbon_chosen_reward_above_bon": above}, common


def ifeval(pairs: dict[str, dict]) -> dict:
    """IFEval's strict figures of one build's pairs (pipeline.judge): chosen and rejected accuracy,
    and pair accuracy over the pairs the judge tells apart."""
    from pipeline.judge import accuracy, check

    chosen, rejected, apart, right = [], [], 0, 0
    for row in pairs.values():
        ids, kwargs = row["instruction_id_list"], row["kwargs"]
        c = check(row["chosen"], ids, kwargs, row["raw_prompt"])
        r = check(row["rejected"], ids, kwargs, row["raw_prompt"])
        chosen.append(c)
        rejected.append(r)
        if sum(c) != sum(r):
            apart += 1
            right += sum(c) > sum(r)
    return {"pairs": len(pairs), "chosen": accuracy(chosen), "rejected": accuracy(rejected),
            "pairs_told_apart": apart, "pair_accuracy": round(right / apart, 4) if apart else math.nan}


def random_sample(used: dict, records: list[dict], device: str) -> dict[str, list[bool]]:
    """prompt_id -> IFEval's per-instruction verdict on one response sampled from the generator
    alone (the builds' sampling settings, candidate 0's seed: one of the builds' own candidates)."""
    from pipeline.data.chat import PromptFormatter
    from pipeline.data.prompts import validate
    from pipeline.decoding.sampling import row_seed
    from pipeline.engines.hf import HFEngine
    from pipeline.judge import check

    engine = HFEngine.from_pretrained(used["generator"], device=device)
    sampling = used["sampling"]
    formatter = PromptFormatter(engine.tokenizer, 10**9, chat_template=used["chat_template"])
    rows, _ = validate([r["prompt"] for r in records], "prompt")
    prompts = [formatter.prepare(row)[0] for row in rows]
    out = engine.generate([p.token_ids for p in prompts], 1, [row_seed(used["seed"], p.prompt_id, 0) for p in prompts],
                          sampling)
    by_prompt = {r["prompt"]: r for r in records}
    return {p.prompt_id: check(o.text, by_prompt[p.raw_prompt]["instruction_id_list"],
                               by_prompt[p.raw_prompt]["kwargs"], p.raw_prompt) for p, o in zip(prompts, out)}


def random_figures(sampled: dict[str, list[bool]], common: list[str]) -> dict:
    from pipeline.judge import accuracy

    return {"all_prompts": {"prompts": len(sampled), **accuracy(list(sampled.values()))},
            "compared_prompts": {"prompts": len(common), **accuracy([sampled[p] for p in common if p in sampled])}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shared, used = settings(args)
    from pipeline.engines.rewards import is_reward_function

    rewards = used["reward"] if isinstance(used["reward"], list) else [used["reward"]]  # a composite: a list
    for key, path in [("generator", used["generator"]), *(("reward", r) for r in rewards)]:
        if not (key == "reward" and is_reward_function(path)) and not Path(path).is_dir():
            fail(f"{path}: no model directory (make real-models, or --{key} DIR)")
    rows = read_prompts(used["prompts_file"], args.num_prompts)
    runs, best, ratios = compare(rows, args.repeats, lambda strategy, prompts: build(strategy, args, shared, prompts))
    pairs = {s: read_pairs(Path(args.output) / s) for s in COMPARED}  # the last run of each (same seed: same pairs)
    scores, common = quality(pairs["best_of_n"], pairs["sbon"])
    verdict = None
    if not args.no_judge:
        both = {s: {p: pairs[s][p] for p in common} for s in COMPARED}
        verdict = {"compared_prompts": len(common), **{s: ifeval(both[s]) for s in COMPARED},
                   "random_sample": random_figures(random_sample(used, rows, args.device), common)}

    print(f"\n{len(rows)} prompts of {used['prompts_file']}, N={used['num_samples']}, T={used['max_new_tokens']}, "
          f"tau={used['decision_token']}, alpha={used['rejection_rate']}, seed {used['seed']}, device {args.device}"
          f" (fastest of {args.repeats}); --set {' '.join(shared)}")
    print_runs(best, ratios, {s: f", {len(pairs[s])} pairs" for s in COMPARED}, speedup_target="  (target >= 2.5)",
               efficiency_target="")
    print(f"normalized score (Eq. 5, mean over {scores['normalized_score_prompts']} prompts)     "
          f"{scores['normalized_score']:.2f}  (target >= 98; min {scores['normalized_score_min']:.2f}, "
          f"{scores['prompts_at_100']} prompts at 100)")
    print(f"mean chosen reward: Best-of-N {scores['mean_chosen_reward']['best_of_n']:.4f}, "
          f"sbon {scores['mean_chosen_reward']['sbon']:.4f}; same chosen sample on "
          f"{scores['same_chosen_sample']}/{scores['paired_prompts']['both']} prompts")
    print(f"checks: sbon chosen reward above Best-of-N's on {scores['sbon_chosen_reward_above_bon']} prompts, "
          f"same sample with different text on {scores['same_sample_different_text']} (both 0 when sbon sampled "
          f"Best-of-N's candidates)")
    if verdict:
        print(f"IFEval (strict; lm-eval's checkers) on the {verdict['compared_prompts']} prompts both builds paired:")
        rand = verdict["random_sample"]
        for name, figures in (("random sample", rand["compared_prompts"]), ("Best-of-N chosen", verdict["best_of_n"]["chosen"]),
                              ("sbon chosen", verdict["sbon"]["chosen"]), ("Best-of-N rejected", verdict["best_of_n"]["rejected"]),
                              ("sbon rejected", verdict["sbon"]["rejected"])):
            print(f"  {name:<20} prompt-level {100 * figures['prompt_level_strict']:.1f}, "
                  f"instruction-level {100 * figures['instruction_level_strict']:.1f}")
        print(f"  random sample on all {rand['all_prompts']['prompts']} prompts: prompt-level "
              f"{100 * rand['all_prompts']['prompt_level_strict']:.1f}, instruction-level "
              f"{100 * rand['all_prompts']['instruction_level_strict']:.1f}")
        for s_ in COMPARED:
            print(f"  pair accuracy {s_}: {verdict[s_]['pair_accuracy']} over the {verdict[s_]['pairs_told_apart']} "
                  f"pairs the judge tells apart, {verdict[s_]['pairs_told_apart'] / max(1, verdict[s_]['pairs']):.2f} "
                  "of its pairs (targets >= 0.9 and >= 0.75)")

    used = {k: v for k, v in used.items() if k != "sampling"}
    write_json(args.json, {"settings": used, "prompts": len(rows), "repeats": args.repeats, **ratios, **scores,
                           "judge": verdict, "runs": best, "all_runs": runs}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
