"""The loop closes: pairs built on the train prompts, one DPO round of the generator on them, and
the generator's own held-out IFEval accuracy before and after.

    python -m benchmarks.dpo_loop [--config configs/real.yaml] [--reward pipeline.judge:ifeval_reward]
        [--strategy best_of_n] [--train-prompts configs/prompts/ifeval-train.jsonl]
        [--eval-prompts configs/prompts/ifeval-eval.jsonl] [--num-samples 4] [--max-new-tokens 128]
        [--eval-max-new-tokens 192] [--epochs 1] [--batch-size 8] [--learning-rate 5e-6] [--beta 0.1]
        [--eval-samples 4] [--resamples 10000] [--output out/bench/dpo-loop] [--json FILE] [--against OTHER.json]

1. ``jobs.build_dataset`` on the train prompts (the config's models and sampling; ``--reward`` and
   the flags above override): TRL-format pairs, each keeping its prompt's IFEval columns;
2. TRL's DPOTrainer on those pairs (pipeline.training.dpo.load_pairs, train_dpo), one round of
   ``--epochs`` passes, from the generator; the policy goes to OUTPUT/policy;
3. before and after: ``--eval-samples`` responses per held-out prompt from the generator and from
   the policy, same sampling settings and the same seeds (pipeline.decoding.sampling.row_seed), judged
   by IFEval's checkers (pipeline.judge, strict): prompt-level and instruction-level accuracy, and
   their gains with a paired bootstrap 95% interval over prompts (pipeline.judge.accuracy_gain), and,
   where a positive gain's interval still reaches 0, about how many held-out prompts would clear it;
   the same on the held-out instructions that brevity does not satisfy by itself (those whose checker
   fails a one-word reply: a DPO round that shortens responses passes word caps and no-comma rules
   for free), and with ``--against`` another run's JSON, this policy's gain over that one's (e.g.
   sbon's pairs against Best-of-N pairs of the same compute), paired by prompt.
The figures: pairs, DPO steps, each step's wall time, the before/after accuracies and the gains; the
JSON keeps every response's per-instruction verdicts. Each step's result is kept under OUTPUT
(pairs, policy, eval-before.json, eval-after.json) and reused by a rerun with the same settings, so
an interrupted run goes on where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from benchmarks import bench_parser, fail, job_argv, parse, run_job, write_json


def parse_args(argv: list[str] | None):
    parser = bench_parser("benchmarks.dpo_loop", __doc__, config="configs/real.yaml",
                          reward=dict(help="models.reward: a model directory or module:function (default: the "
                                           "config's)"),
                          strategy="best_of_n", num_samples=dict(default=4, help="N of the pair build"),
                          max_new_tokens=dict(default=128, help="T of the pair build"),
                          set=dict(default=[], help="passed to the pair build"), output="out/bench/dpo-loop", json=None)
    parser.add_argument("--train-prompts", default="configs/prompts/ifeval-train.jsonl")
    parser.add_argument("--eval-prompts", default="configs/prompts/ifeval-eval.jsonl")
    parser.add_argument("--eval-max-new-tokens", type=int, default=192)
    parser.add_argument("--eval-samples", type=int, default=4, help="responses per held-out prompt, before and after")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=5e-6)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--resamples", type=int, default=10000, help="bootstrap resamples of the held-out prompts")
    parser.add_argument("--against", metavar="JSON",
                        help="another run's --json, evaluated with the same held-out settings (e.g. Best-of-N pairs "
                             "of the same compute): this policy's gain over that one's, paired by prompt")
    return parse(parser, argv)


def held_out_rows(prompt_file: str) -> list:
    """The usable prompt rows of ``prompt_file`` (pipeline.data.prompts.validate), with their IFEval columns."""
    from pipeline.data.prompts import read_prompt_file

    return read_prompt_file(prompt_file)[0]


def judged_samples(model: str, prompt_file: str, samples: int, sampling, seed: int, chat_template: str,
                   texts: bool = False) -> dict:
    """IFEval's strict figures of ``samples`` responses per prompt of ``prompt_file`` from ``model``
    (rows seeded as a build seeds its candidates 0 .. samples - 1); with ``texts``, also each
    response's text and token count (``texts``, ``tokens``: per prompt, per response)."""
    from pipeline.data.chat import PromptFormatter
    from pipeline.decoding.sampling import row_seed
    from pipeline.engines.hf import HFEngine
    from pipeline.judge import accuracy, check

    engine = HFEngine.from_pretrained(model)
    formatter = PromptFormatter(engine.tokenizer, 10**9, chat_template=chat_template)
    prompts = [formatter.prepare(row)[0] for row in held_out_rows(prompt_file)]
    seeds = [row_seed(seed, p.prompt_id, s) for p in prompts for s in range(samples)]
    out = engine.generate([p.token_ids for p in prompts], samples, seeds, sampling)
    judged = [check(o.text, prompts[i // samples].columns["instruction_id_list"],
                    prompts[i // samples].columns["kwargs"], prompts[i // samples].raw_prompt)
              for i, o in enumerate(out)]
    return {"prompts": len(prompts), "responses": len(judged), **accuracy(judged),
            "mean_tokens": round(sum(len(o.token_ids) for o in out) / max(1, len(out)), 1),
            "verdicts": [judged[i * samples:(i + 1) * samples] for i in range(len(prompts))],
            **({"texts": [[o.text for o in out[i * samples:(i + 1) * samples]] for i in range(len(prompts))],
                "tokens": [[len(o.token_ids) for o in out[i * samples:(i + 1) * samples]] for i in range(len(prompts))]}
               if texts else {})}


BRIEF_REPLY = "Yes."
"""A one-word reply: the held-out instructions its checker passes are those brevity satisfies by itself."""


def brief_reply_passes(prompt_file: str) -> list[list[bool]]:
    """Per held-out prompt, per instruction: whether IFEval's strict checker passes BRIEF_REPLY (a cap
    on words or sentences, no commas, a forbidden word...). A gain on the other instructions is not
    shorter responses alone."""
    from pipeline.data.chat import conversation_text
    from pipeline.judge import check

    return [check(BRIEF_REPLY, r.columns["instruction_id_list"], r.columns["kwargs"],
                  r.prompt if isinstance(r.prompt, str) else conversation_text(r.prompt))
            for r in held_out_rows(prompt_file)]


def beyond_brevity(verdicts: list[list[list[bool]]], brief: list[list[bool]]) -> tuple[list, list[int]]:
    """``verdicts`` (per prompt, per response, per instruction) with only the instructions a brief reply
    fails, and the prompts that keep at least one (the others are left out)."""
    keep = [i for i, passes in enumerate(brief) if not all(passes)]
    return [[[v for v, easy in zip(response, brief[i]) if not easy] for response in verdicts[i]] for i in keep], keep


def gains(before: list, after: list, brief: list[list[bool]], resamples: int, seed: int) -> dict:
    """accuracy_gain from ``before`` to ``after`` on all instructions and on those a brief reply fails."""
    from pipeline.judge import accuracy_gain

    if len(before) != len(brief) or len(after) != len(brief):
        fail(f"{len(before)} and {len(after)} judged prompts against {len(brief)} held-out prompts: not the same "
             "held-out set")
    hard_before, kept = beyond_brevity(before, brief)
    return {**accuracy_gain(before, after, resamples=resamples, seed=seed),
            "beyond_brevity": accuracy_gain(hard_before, beyond_brevity(after, brief)[0], resamples=resamples,
                                            seed=seed) if kept else None}


def print_gains(title: str, figures: dict) -> None:
    for scope, g in (("", figures), (" (instructions a one-word reply fails)", figures["beyond_brevity"])):
        if g is None:
            print(f"{title}{scope}: no such held-out instruction")
            continue
        for key, name in (("prompt_level_strict", "prompt-level"), ("instruction_level_strict", "instruction-level")):
            f = g[key]
            print(f"{title}{scope}: {name} {100 * f['before']:.1f} -> {100 * f['after']:.1f}, {100 * f['gain']:+.1f} "
                  f"points, bootstrap 95% interval over {g['prompts']} prompts [{100 * f['low']:+.1f}, "
                  f"{100 * f['high']:+.1f}]" + (f"; above 0 with about {f['prompts_to_clear_zero']} prompts at this gain "
                                                 "and spread" if f["prompts_to_clear_zero"] and f["low"] <= 0 else ""))


def cached(path: Path, settings: dict, compute) -> dict:
    """compute()'s result, kept at ``path`` with the settings that made it; reused while they match."""
    if path.exists():
        kept = json.loads(path.read_text())
        if kept.get("settings") == json.loads(json.dumps(settings)):  # as JSON keeps them (tuples as lists)
            return kept["result"]
    result = compute()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"settings": settings, "result": result}))
    tmp.replace(path)
    return result


def against(path: str, figures: dict) -> dict:
    """Another run's JSON, judged on the same held-out responses' seeds; one line and exit 2 otherwise."""
    try:
        other = json.loads(Path(path).read_text())
        verdicts = other["after"]["verdicts"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        fail(f"--against {path}: not a benchmarks.dpo_loop JSON with the policy's verdicts ({type(exc).__name__}: {exc})")
    ours = figures["after"]
    if len(verdicts) != ours["prompts"] or other["after"].get("responses") != ours["responses"]:
        fail(f"--against {path}: {len(verdicts)} prompts and {other['after'].get('responses')} responses, against "
             f"this run's {ours['prompts']} and {ours['responses']}: evaluate both on the same held-out settings")
    return other


def main(argv: list[str] | None = None) -> int:
    import torch

    from pipeline.coordinator import sampling_params
    from pipeline.config import ConfigError, load_config
    from pipeline.training.dpo import load_pairs, train_dpo

    args = parse_args(argv)
    out = Path(args.output)
    sets = [f"sampling.num_samples={args.num_samples}", f"sampling.max_new_tokens={args.max_new_tokens}",
            *([f"models.reward={args.reward}", "models.reward_weights=null"] if args.reward else []), *args.overrides]
    try:
        config = load_config(args.config, sets, strategy=args.strategy)
    except ConfigError as e:
        fail(str(e))
    figures: dict = {"config": args.config, "strategy": args.strategy, "reward": config.models.reward,
                     "generator": config.models.generator, "pair_build": {"num_samples": args.num_samples,
                                                                          "max_new_tokens": args.max_new_tokens}}
    threads = torch.get_num_threads()
    start = time.perf_counter()
    report = run_job(args.strategy, job_argv(args.config, args.strategy, args.train_prompts, out / "pairs", sets,
                                             overwrite=False), out / "pairs")
    manifest = json.loads((out / "pairs" / "_manifest.json").read_text())
    # A rerun resumes a finished build (this run then makes no pairs): the manifest counts them all.
    figures["pair_build"].update(pairs=manifest["pairs"], prompts=manifest["prompts_in"],
                                 generated_tokens=manifest["generated_tokens"],
                                 seconds_this_run=round(time.perf_counter() - start, 1),
                                 pairs_this_run=report["pairs"])
    print(f"pairs: {manifest['pairs']} from {manifest['prompts_in']} prompts of {args.train_prompts} "
          f"({report['pairs']} made in this run's {figures['pair_build']['seconds_this_run']}s)", flush=True)

    # In-process (runtime.local) the build's actors set torch's threads to their num_cpus; DPO and the
    # evaluations get the process's own again.
    torch.set_num_threads(threads)
    pairs = load_pairs(str(out / "pairs"))
    steps = max(1, int(args.epochs * len(pairs) / args.batch_size))
    dpo_settings = {"pairs": len(pairs), "pairs_config_hash": manifest["config_hash"], "steps": steps, "batch_size": args.batch_size,
                    "learning_rate": args.learning_rate, "beta": args.beta, "max_length": args.max_length,
                    "generator": config.models.generator, "seed": config.seed}

    def dpo_round() -> dict:
        start = time.perf_counter()
        metrics = train_dpo(pairs, config.models.generator, str(out / "policy"), max_steps=steps,
                            batch_size=args.batch_size, learning_rate=args.learning_rate, beta=args.beta,
                            max_length=args.max_length, seed=config.seed, progress=False)
        return {"batch_size": args.batch_size, "learning_rate": args.learning_rate, "beta": args.beta,
                "seconds": round(time.perf_counter() - start, 1), **metrics}

    figures["dpo"] = cached(out / "dpo.json", dpo_settings, dpo_round)
    print(f"DPO: {figures['dpo']['steps']} steps of {args.batch_size} pairs in {figures['dpo']['seconds']}s, "
          f"loss {figures['dpo']['train_loss']:.4f}", flush=True)

    eval_sampling = dataclasses.replace(sampling_params(config), max_new_tokens=args.eval_max_new_tokens)
    for name, model in (("before", config.models.generator), ("after", str(out / "policy"))):
        def evaluate(model=model) -> dict:
            start = time.perf_counter()
            result = judged_samples(model, args.eval_prompts, args.eval_samples, eval_sampling, config.seed,
                                    config.sampling.chat_template)
            return {**result, "seconds": round(time.perf_counter() - start, 1)}

        settings = {"model": model, "prompts": args.eval_prompts, "samples": args.eval_samples,
                    "sampling": dataclasses.asdict(eval_sampling), "seed": config.seed,
                    "chat_template": config.sampling.chat_template, **({"dpo": dpo_settings} if name == "after" else {})}
        figures[name] = cached(out / f"eval-{name}.json", settings, evaluate)
        f = figures[name]
        print(f"held-out IFEval {name:<6} ({f['responses']} responses, {f['prompts']} prompts): prompt-level "
              f"{100 * f['prompt_level_strict']:.1f}, instruction-level {100 * f['instruction_level_strict']:.1f}, "
              f"mean {f['mean_tokens']} tokens ({f['seconds']}s)", flush=True)
    brief = brief_reply_passes(args.eval_prompts)
    figures["brief_reply_passes"] = brief
    figures["gain"] = gains(figures["before"]["verdicts"], figures["after"]["verdicts"], brief, args.resamples,
                            config.seed)
    print_gains("gain", figures["gain"])
    if args.against:
        other = against(args.against, figures)
        figures["against"] = {"json": args.against, "strategy": other["strategy"], "pair_build": other["pair_build"],
                              **gains(other["after"]["verdicts"], figures["after"]["verdicts"], brief, args.resamples,
                                      config.seed)}
        print_gains(f"this policy over {args.against}'s ({other['strategy']} pairs)", figures["against"])
    write_json(args.json, figures, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
