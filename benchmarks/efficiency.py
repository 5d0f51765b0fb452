"""End-to-end efficiency: does speculative rejection's token saving reach the wall clock of a build?

    python -m benchmarks.efficiency [--models bench|DIR] [--num-prompts 24] [--num-samples 16]
        [--max-new-tokens 128] [--decision-token 16] [--rejection-rate 0.875] [--seed 0]
        [--repeats 1] [--set KEY=VALUE ...] [--json FILE]

Runs the same build twice through ``jobs.build_dataset.main``, with Ray actors (the build's
default; ``--set runtime.local=true`` would run it in-process): Best-of-N and speculative
rejection (sbon), same prompts (the first ``--num-prompts`` of MODELS/prompts.jsonl), same seed, same
settings (configs/demo.yaml with the bench models from ``python -m jobs.bench_models --output
MODELS``, plus every ``--set``). From each run's ``_report.json``:

    efficiency = (Best-of-N run_seconds / sbon run_seconds) x (sbon tokens / Best-of-N tokens)

run_seconds runs from the first batch dispatched to the last shard committed (startup, i.e. cluster,
actors and model loads, is left out); tokens are the tokens each run generated. 1.0: the wall clock
falls exactly as far as the tokens do; below 1, part of the saving is lost on the way (the
target was >= 0.85). Each run's actor time breakdown (forward passes, sampling and bookkeeping,
waiting for rewards or for work, Ray calls) says where. With ``--repeats R`` the two builds
alternate R times and the fastest run of each is kept, as in benchmarks.scaling.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Callable

from benchmarks import (bench_parser, fastest, job_argv, model_dirs, model_prompts, parse, read_prompts, run_job,
                        side_by_side, write_json, write_prompts)

COMPARED = ("best_of_n", "sbon")


def parse_args(argv: list[str] | None):
    parser = bench_parser("benchmarks.efficiency", __doc__, models="bench", num_prompts=24, num_samples=16,
                          max_new_tokens=128, seed=0, repeats=1,
                          set=dict(default=[], help="passed to both builds, e.g. --set runtime.batches_in_flight=4"),
                          output="out/bench/efficiency", json=None)
    parser.add_argument("--decision-token", type=int, default=16, help="sbon's tau")
    parser.add_argument("--rejection-rate", type=float, default=0.875, help="sbon's alpha")
    return parse(parser, argv)


def build(strategy: str, args, models: dict[str, str], prompts: Path) -> dict:
    """One build through the build job; its run report."""
    overrides = [f"models.generator={models['generator']}", f"models.reward={models['reward']}", "models.reward_weights=null",
                 f"sampling.num_samples={args.num_samples}", f"sampling.max_new_tokens={args.max_new_tokens}",
                 f"seed={args.seed}"]
    if strategy == "sbon":
        overrides += [f"strategy.decision_token={args.decision_token}", f"strategy.rejection_rate={args.rejection_rate}"]
    output = Path(args.output) / strategy
    return run_job(strategy, job_argv("configs/demo.yaml", strategy, prompts, output, overrides + args.overrides),
                   output)


def efficiency(bon: dict, sbon: dict) -> dict:
    """The same-run ratios of the two reports."""
    speedup = bon["run_seconds"] / sbon["run_seconds"]
    token_rate = sbon["generated_tokens"] / bon["generated_tokens"]
    return {"speedup": round(speedup, 3), "token_rate": round(token_rate, 3),
            "efficiency": round(speedup * token_rate, 3)}


def compare(rows: list[dict], repeats: int, build_one: Callable[[str, Path], dict]) -> tuple[dict, dict, dict]:
    """Both builds on the prompt ``rows``, ``repeats`` times in alternating order (drift on a shared
    machine hits both): (every run's report by strategy, the fastest of each by run_seconds, their ratios)."""
    with tempfile.TemporaryDirectory() as tmp:
        prompts = write_prompts(rows, Path(tmp) / "prompts.jsonl")
        runs = side_by_side({s: (lambda s=s: build_one(s, prompts)) for s in COMPARED}, repeats)
    best = {s: run.value for s, run in fastest(runs, lambda run: run.value["run_seconds"]).items()}
    every = {s: [run.value for run in each] for s, each in runs.items()}
    return every, best, efficiency(best["best_of_n"], best["sbon"])


def print_runs(best: dict, ratios: dict, extra: dict[str, str] | None = None, speedup_target: str = "",
               efficiency_target: str = "  (target >= 0.85)") -> None:
    """Each strategy's fastest run (``extra[strategy]`` appended), its actors' time, and the ratios."""
    from pipeline.observability import format_actor_time

    for strategy in COMPARED:
        report = best[strategy]
        print(f"{strategy:<10} run {report['run_seconds']:.2f}s (startup {report['startup_seconds']:.1f}s), "
              f"{report['generated_tokens']} tokens{(extra or {}).get(strategy, '')}")
        for role, times in (report.get("actor_time") or {}).items():
            print(f"  {role + ' time':<15}{format_actor_time(times)}")
    print(f"speedup (Best-of-N run_seconds / sbon run_seconds)  {ratios['speedup']:.3f}{speedup_target}")
    print(f"token rate (sbon tokens / Best-of-N tokens)          {ratios['token_rate']:.3f}")
    print(f"efficiency (speedup x token rate)                    {ratios['efficiency']:.3f}{efficiency_target}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    models = model_dirs(args.models)
    rows = read_prompts(model_prompts(args.models), args.num_prompts)
    runs, best, ratios = compare(rows, args.repeats, lambda strategy, prompts: build(strategy, args, models, prompts))

    print(f"\n{len(rows)} prompts, N={args.num_samples}, T={args.max_new_tokens}, tau={args.decision_token}, "
          f"alpha={args.rejection_rate}, seed {args.seed}" + (f", --set {' '.join(args.overrides)}" if args.overrides
                                                               else "") + f" (fastest of {args.repeats})")
    print_runs(best, ratios)
    write_json(args.json, {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "command")},
                           "prompts": len(rows), **ratios, "runs": best, "all_runs": runs}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
