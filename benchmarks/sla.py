"""SLA bench figures, all measured in one run on the same models and prompts.

    python -m benchmarks.sla [--models DIR] [--device cpu|cuda] [--train-prompts 256] [--eval-prompts 64]
        [--max-new-tokens 32] [--hidden-size 256] [--epochs 3] [--learning-rate 1e-3] [--threads 1]
        [--prompts FILE [--eval-prompts-file FILE]] [--no-adapter] [--dpo-steps 0]
        [--pairs DIR] [--json benchmarks/results/sla.json] [--plot FILE]

--models DIR holds DIR/generator and DIR/reward (what `python -m jobs.make_tiny_models` and
`python -m jobs.fetch_models` write; bench and real name those sets); by default the random-weight
tiny models (of --seed). Prompts, two modes:

- files: --prompts FILE (JSONL with a "prompt" field; the first --train-prompts rows) for the pair
  build, and --eval-prompts-file FILE (default configs/prompts/ifeval-eval.jsonl, the held-out
  verifiable-instruction prompts; the first --eval-prompts rows), whose rows also carry IFEval's
  instruction_id_list and kwargs columns;
- without files, the tiny models' grammar (requests about products, tokens those models were
  trained on): disjoint training and held-out requests, each held-out one followed by 1 to 3
  instructions from IFEval's registry as jobs.make_ifeval_prompts draws them (``make_rows``).

The recipe:

1. pairs: our build (best_of_n, --num-samples samples at --temperature, best and worst by the
   labeling reward model: the paper's data collection, section 5) on the training prompts;
   --pairs DIR keeps the build in DIR and reuses it on a later run whose models (directories and
   weight files), prompts and sampling settings are the same (DIR/bench-settings.json; any
   difference rebuilds);
2. setting 1: the Reward Transformer's channel trained with Bradley-Terry on a frozen policy;
   the adapter baseline (one linear head on the last hidden state) trained the same way;
3. setting 2: DPO on the same pairs, then the channel on the DPO policy;
4. on the held-out prompts, every response judged by IFEval's checkers (pipeline.judge via
   pipeline.evaluation, strict: a response scores the fraction of its prompt's instructions it
   follows), which neither the labeling reward model nor the channel was trained on: SLA vs greedy
   (win rate = wins + ties/2, a tie being an equal score) and both methods' IFEval prompt-level and
   instruction-level accuracy, for the frozen policy and after DPO (vs the DPO model's greedy, and
   vs the original greedy; --dpo-steps 0 skips setting 2). SLA searches with the channel; the
   labeling reward model only scores its kept candidate (pipeline.decoding.model_side);
5. SLA's decoding cost relative to greedy (tokens, sequential forward passes, wall time) next to
   the paper's log_k(N) = d estimate (Eq. 11, N = k^d explored leaves);
6. AuTRC of the Reward Transformer vs the adapter on the held-out pairs (curves in a PNG, --plot,
   by default the --json path with .png; --no-adapter skips the adapter): agreement of partial-response rewards with the labeling reward
   model's pair labels, a figure of reward modelling, not of quality.

On the random-weight tiny models the figures exercise the code and mean nothing.
Targets (issue): SLA win rate >= 70% against greedy; Reward Transformer AuTRC > adapter's.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import bench_parser, fail, model_dirs, parse, read_prompts, write_json, write_png

JUDGE = "IFEval strict (pipeline.judge: lm-eval's instruction checkers)"
HELD_OUT = "configs/prompts/ifeval-eval.jsonl"
"""The default --eval-prompts-file with --prompts: our held-out verifiable-instruction prompts."""


def bench_prompts(train: int, evaluate: int, seed: int, train_file: str | None = None,
                  eval_file: str | None = None) -> tuple[list[str], list[str]]:
    """Disjoint prompt sets: the first rows of the two JSONL files when given, else from the tiny
    models' grammar (requests about products)."""
    from jobs.make_tiny_models import ADVERBS, ASKS, SUBJECTS, VERBS

    if train_file or eval_file:
        if not (train_file and eval_file):
            fail("--prompts and --eval-prompts-file go together")
        chosen = [[row["prompt"] for row in read_prompts(path, count, exactly=True)]
                  for path, count in ((train_file, train), (eval_file, evaluate))]
        overlap = set(chosen[0]) & set(chosen[1])
        if overlap:
            fail(f"{eval_file}: {len(overlap)} prompts also in {train_file}")
        return chosen[0], chosen[1]

    pool = [f"{a} {s}." for a in ASKS for s in SUBJECTS]
    pool += [f"Explain why {s} {v} {adv}." for s in SUBJECTS for v in VERBS for adv in ADVERBS]
    random.Random(seed).shuffle(pool)
    if train + evaluate > len(pool):
        raise SystemExit(f"error: at most {len(pool)} prompts")
    return pool[:train], pool[train:train + evaluate]


def held_out_rows(prompts: list[str], eval_file: str | None, seed: int) -> list[dict]:
    """The held-out prompts as rows the judge reads: prompt, instruction_id_list, kwargs. From
    ``eval_file``, its rows' own columns (the first len(prompts) rows, as bench_prompts read them;
    exit 2 naming the row when they are missing or name what the judge cannot check); for the
    grammar's requests, instructions drawn as jobs.make_ifeval_prompts draws them (seeded), their
    descriptions appended to the request."""
    from pipeline.evaluation import instructions
    from pipeline.judge import check

    if eval_file is None:
        from jobs.make_ifeval_prompts import make_rows

        return [{"prompt": r["prompt"], "instruction_id_list": r["instruction_id_list"], "kwargs": r["kwargs"]}
                for r in make_rows(tuple(prompts), len(prompts), 0, random.Random(seed), set())]
    rows = []
    for number, row in enumerate(read_prompts(eval_file, len(prompts), exactly=True), 1):
        try:
            found = instructions(row)
            if found is None:
                raise ValueError(f"no instruction_id_list/kwargs columns to judge it by (IFEval's data, as {HELD_OUT})")
            check("", *found, row["prompt"])  # builds every checker: an id or kwargs it cannot take raise here
        except ValueError as e:
            fail(f"{eval_file}: prompt {number}: {e}")
        rows.append({"prompt": row["prompt"], "instruction_id_list": found[0], "kwargs": found[1]})
    return rows


def build_pairs(generator: str, reward: str, prompts: list[str], output: Path, args) -> dict:
    from actors import start_workers
    from pipeline.build import plan_build, run_build
    from pipeline.config import config_from_dict

    output.mkdir(parents=True, exist_ok=True)
    prompt_file = output.parent / f"{output.name}-prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    config = config_from_dict({
        "models": {"generator": generator, "reward": reward, "device": args.device},
        "strategy": {"name": "best_of_n"},
        "sampling": {"num_samples": args.num_samples, "max_new_tokens": args.max_new_tokens,
                     "temperature": args.temperature},
        "data": {"prompts": str(prompt_file), "output": str(output), "shard_size": 64},
        "runtime": {"local": True, "prompts_per_batch": 16},
        "seed": args.seed,
    })
    workers = start_workers(config)
    try:
        return run_build(plan_build(config), workers, progress=False)
    finally:
        workers.shutdown()
        prompt_file.unlink()


def pair_build(generator: str, reward: str, prompts: list[str], work: Path, args) -> tuple[Path, str]:
    """The pair build's directory (in ``--pairs DIR``, else in ``work``), built unless DIR holds one
    with the same settings; and how it was had (built, or reused)."""
    if not args.pairs:
        build_pairs(generator, reward, prompts, work / "pairs", args)
        return work / "pairs", "built"
    output = Path(args.pairs)
    stamp = output / "bench-settings.json"
    def model(path: str) -> dict:  # the directory and its weight files' sizes and times: a retrained model rebuilds
        return {"path": str(Path(path).resolve()), "weights": {f.name: [f.stat().st_size, f.stat().st_mtime_ns]
                                                               for f in sorted(Path(path).glob("*.safetensors"))}}

    settings = {"generator": model(generator), "reward": model(reward), "prompts": prompts, "num_samples": args.num_samples, "max_new_tokens": args.max_new_tokens,
                "temperature": args.temperature, "seed": args.seed, "device": args.device}
    if (output / "_SUCCESS").exists() and stamp.exists() and json.loads(stamp.read_text()) == settings:
        return output, f"reused from {output}"
    if output.exists():
        if not stamp.exists():
            fail(f"--pairs {output}: exists but holds no pair build of this benchmark (no {stamp.name})")
        print(f"--pairs {output}: settings changed, rebuilding", flush=True)
        shutil.rmtree(output)
    build_pairs(generator, reward, prompts, output, args)
    stamp.write_text(json.dumps(settings, indent=1))
    return output, f"built into {output}"


def eval_inputs(engine, rows: list[dict], max_new_tokens: int):
    """The held-out rows as PromptInputs, their instruction columns kept for the judge."""
    from pipeline.data.chat import PromptFormatter, PromptRow

    formatter = PromptFormatter(engine.tokenizer, engine.max_context - max_new_tokens)
    return [formatter.prepare(PromptRow(i, r["prompt"], {k: r[k] for k in ("instruction_id_list", "kwargs")}))[0]
            for i, r in enumerate(rows)]


def sla_vs_greedy(model_dir: str, reward, rows: list[dict], args, original=None) -> tuple[dict, object]:
    """SLA and greedy on one model, each response judged by IFEval (pipeline.evaluation.judged;
    ``reward``, the labeling reward model, scores SLA's kept candidate and judges nothing); with
    ``original`` (another model's judged greedy run) also both against it. Returns the report and
    this model's greedy run."""
    from pipeline.decoding.sla import SLAParams
    from pipeline.engines.hf import HFEngine
    from pipeline.evaluation import judged, summarize

    engine = HFEngine.from_pretrained(model_dir, device=args.device)
    inputs = eval_inputs(engine, rows, args.max_new_tokens)
    params = SLAParams(args.search_depth, args.search_width, args.step_size)
    for method in ("greedy", "sla"):  # warm-up, so neither timing pays first-call costs
        judged(method, engine, reward, inputs[:2], args.max_new_tokens, args.seed, sla_params=params)
    greedy = judged("greedy", engine, reward, inputs, args.max_new_tokens, args.seed)
    sla = judged("sla", engine, reward, inputs, args.max_new_tokens, args.seed, sla_params=params,
                 sla_temperature=args.sla_temperature)
    report = {"greedy": summarize(greedy, greedy), "sla": summarize(sla, greedy)}
    if original is not None:
        report["sla_vs_original_greedy"] = summarize(sla, original)
        report["greedy_vs_original_greedy"] = summarize(greedy, original)
    return report, greedy


def plot_autrc(plt, rt: dict, adapter: dict):
    """Agreement with the final label against the fraction of the response read, both reward models."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(rt["autrc_fractions"], rt["autrc_curve"], label=f"Reward Transformer (AuTRC {rt['autrc']:.3f})")
    ax.plot(adapter["autrc_fractions"], adapter["autrc_curve"], label=f"linear adapter (AuTRC {adapter['autrc']:.3f})")
    ax.set_xlabel("fraction of the response")
    ax.set_ylabel("agreement with the final label")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right", fontsize=8)
    return fig


def main(argv=None) -> int:
    parser = bench_parser("benchmarks.sla", __doc__,
                          models=dict(default="tiny", help="tiny (of --seed), bench, real, or a directory with "
                                                           "generator/ and reward/"),
                          device="cpu", max_new_tokens=32,
                          prompts=dict(help="training prompts, JSONL (default: the tiny grammar)"),
                          num_samples=dict(default=5, help="samples per prompt of the pair build"), seed=0, threads=1,
                          json="benchmarks/results/sla.json",
                          plot=dict(help="the AuTRC curves, PNG (default: the --json path with .png)"))
    parser.add_argument("--train-prompts", type=int, default=256)
    parser.add_argument("--eval-prompts", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=256, help="reward channel width (the paper: 256)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--eval-prompts-file", default=None,
                        help=f"held-out prompts with IFEval's columns, JSONL (with --prompts; default {HELD_OUT})")
    parser.add_argument("--temperature", type=float, default=0.8, help="temperature of the pair build")
    parser.add_argument("--no-adapter", action="store_true", help="skip the linear-adapter baseline (AuTRC)")
    parser.add_argument("--dpo-steps", type=int, default=30, help="0 skips setting 2 (DPO)")
    parser.add_argument("--dpo-learning-rate", type=float, default=1e-4)
    parser.add_argument("--search-depth", type=int, default=2)
    parser.add_argument("--search-width", type=int, default=2)
    parser.add_argument("--step-size", type=int, default=10)
    parser.add_argument("--sla-temperature", type=float, default=1.0)
    parser.add_argument("--pairs", default=None, metavar="DIR",
                        help="keep the pair build in DIR and reuse it when the settings match")
    args = parse(parser, argv)
    args.plot = args.plot or str(Path(args.json).with_suffix(".png"))
    with tempfile.TemporaryDirectory(prefix="bench-sla-") as work:
        return run(args, Path(work))


def run(args, work: Path) -> int:
    from pipeline.engines.rewards import RewardScorer
    from pipeline.training.dpo import load_pairs
    from pipeline.training.reward_channel import train_reward_transformer

    start = time.perf_counter()
    # Prompts first: a bad file fails in a moment, not after the models are built.
    eval_file = args.eval_prompts_file or (HELD_OUT if args.prompts else None)
    train_prompts, eval_prompts = bench_prompts(args.train_prompts, args.eval_prompts, args.seed, args.prompts,
                                                eval_file)
    eval_rows = held_out_rows(eval_prompts, eval_file, args.seed)
    models = model_dirs(args.models, seed=args.seed)
    generator, reward = models["generator"], models["reward"]
    source = "random tiny models (make_tiny_models)" if args.models == "tiny" else args.models
    print(f"models: {source}; {len(train_prompts)} training prompts, {len(eval_prompts)} held-out prompts", flush=True)

    pair_dir, how = pair_build(generator, reward, train_prompts, work, args)
    manifest = json.loads((pair_dir / "_manifest.json").read_text())
    pairs = load_pairs(str(pair_dir))
    print(f"pairs from our build ({how}): {len(pairs)} ({manifest['prompts_rejected']} prompts without a pair)",
          flush=True)
    train = dict(hidden_size=args.hidden_size, epochs=args.epochs, learning_rate=args.learning_rate,
                 seed=args.seed, device=args.device, progress=False)
    rt = train_reward_transformer(pairs, generator, str(work / "rt"), **train)
    print(f"Reward Transformer: held-out pairwise accuracy {rt['pairwise_accuracy']:.1%}, AuTRC {rt['autrc']:.3f} "
          f"({time.perf_counter() - start:.0f}s)", flush=True)
    adapter = None if args.no_adapter else train_reward_transformer(pairs, generator, str(work / "adapter"),
                                                                    kind="adapter", **train)
    dpo = None if args.dpo_steps == 0 else train_reward_transformer(
        pairs, generator, str(work / "rt-dpo"), dpo=True, dpo_steps=args.dpo_steps,
        dpo_learning_rate=args.dpo_learning_rate, **train)

    reward_scorer = RewardScorer.from_pretrained(reward, device=args.device)
    frozen, greedy = sla_vs_greedy(str(work / "rt"), reward_scorer, eval_rows, args)
    after_dpo = None if dpo is None else sla_vs_greedy(str(work / "rt-dpo"), reward_scorer, eval_rows, args,
                                                       original=greedy)[0]

    d, k = args.search_depth, args.search_width
    n_leaves = k ** d
    sla = frozen["sla"]
    figures = {
        "models": source,
        "train_pairs": len(pairs),
        "eval_prompts": len(eval_rows),
        "eval_prompts_source": eval_file or "tiny grammar + IFEval instructions (jobs.make_ifeval_prompts.make_rows)",
        "judge": JUDGE,
        "max_new_tokens": args.max_new_tokens,
        "sla_params": {"search_depth": d, "search_width": k, "step_size": args.step_size},
        "win_rate_sla_vs_greedy_frozen": sla["win_rate"],
        "win_rate_sla_vs_greedy_after_dpo": after_dpo and after_dpo["sla"]["win_rate"],
        "win_rate_dpo_sla_vs_original_greedy": after_dpo and after_dpo["sla_vs_original_greedy"]["win_rate"],
        "win_rate_dpo_greedy_vs_original_greedy": after_dpo and after_dpo["greedy_vs_original_greedy"]["win_rate"],
        "ifeval_accuracy": {
            name: {method: {level: run[method][level] for level in ("prompt_level_strict", "instruction_level_strict")}
                   for method in ("greedy", "sla")}
            for name, run in (("frozen", frozen), ("after_dpo", after_dpo)) if run},
        "cost_vs_greedy": {
            "paper_estimate_log_k_N": math.log(n_leaves, k),
            "forward_passes": sla["forward_pass_cost_vs_greedy"],
            "wall_time": sla["time_cost_vs_greedy"],
            "tokens": sla["token_cost_vs_greedy"],
        },
        "autrc": {"reward_transformer": rt["autrc"], "adapter": adapter and adapter["autrc"],
                  "reward_transformer_dpo": dpo and dpo["autrc"]},
        "heldout_pairwise_accuracy": {"reward_transformer": rt["pairwise_accuracy"],
                                      "adapter": adapter and adapter["pairwise_accuracy"]},
        "targets": {"sla_win_rate_ge_0.7": sla["win_rate"] >= 0.7,
                    "rt_autrc_gt_adapter": adapter and rt["autrc"] > adapter["autrc"]},
        "details": {"frozen": frozen, "after_dpo": after_dpo, "rt_training": rt, "adapter_training": adapter,
                    "dpo_training": dpo},
        "wall_seconds": round(time.perf_counter() - start, 1),
        "device": args.device,
    }
    write_json(args.json, figures, args)
    if adapter:
        write_png(args.plot, lambda plt: plot_autrc(plt, rt, adapter))

    c = figures["cost_vs_greedy"]
    print(f"SLA (d={d}, k={k}, n={args.step_size}) vs greedy, judged by {JUDGE} on {len(eval_rows)} held-out prompts:")
    print(f"  frozen policy:  win rate {sla['win_rate']:.1%} (win {sla['win']:.1%} tie {sla['tie']:.1%} "
          f"loss {sla['loss']:.1%})   target >= 70%: {'met' if sla['win_rate'] >= 0.7 else 'NOT met'}")
    if after_dpo:
        print(f"  after DPO:      win rate {after_dpo['sla']['win_rate']:.1%} vs DPO greedy; "
              f"{figures['win_rate_dpo_sla_vs_original_greedy']:.1%} vs original greedy "
              f"(DPO greedy vs original greedy: {figures['win_rate_dpo_greedy_vs_original_greedy']:.1%})")
    for name, run in (("frozen", frozen), ("after DPO", after_dpo)):
        if run:
            print(f"  IFEval strict accuracy ({name}), prompt / instruction level: "
                  + "; ".join(f"{m} {run[m]['prompt_level_strict']:.1%} / {run[m]['instruction_level_strict']:.1%}"
                              for m in ("greedy", "sla")))
    print(f"  cost vs greedy: forward passes x{c['forward_passes']:.2f}, wall time x{c['wall_time']:.2f}, "
          f"tokens x{c['tokens']:.2f}; paper's estimate log_k(N) = {c['paper_estimate_log_k_N']:.2f}")
    if adapter:
        print(f"AuTRC on held-out pairs: Reward Transformer {rt['autrc']:.3f} vs adapter {adapter['autrc']:.3f} "
              f"(pairwise accuracy {rt['pairwise_accuracy']:.1%} vs {adapter['pairwise_accuracy']:.1%})   "
              f"target RT > adapter: {'met' if rt['autrc'] > adapter['autrc'] else 'NOT met'}")
    print(f"({figures['wall_seconds']}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
