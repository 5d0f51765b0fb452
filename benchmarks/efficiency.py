"""End-to-end efficiency: does speculative rejection's token saving reach the wall clock of a build?

    python -m benchmarks.efficiency [--models .cache/bench-models] [--prompts 24] [--num-samples 16]
        [--max-new-tokens 128] [--decision-token 16] [--rejection-rate 0.875] [--seed 0]
        [--repeats 1] [--set KEY=VALUE ...] [--json FILE]

Runs the same build twice through ``jobs.build_dataset.main``, with Ray actors (the build's
default; ``--set runtime.local=true`` would run it in-process): Best-of-N and speculative
rejection (sbon), same prompts (the first ``--prompts`` of MODELS/prompts.jsonl), same seed, same
settings (configs/demo.yaml with the bench models from ``python -m jobs.bench_models --output
MODELS``, plus every ``--set``). From each run's ``_report.json``:

    efficiency = (Best-of-N run_seconds / sbon run_seconds) x (sbon tokens / Best-of-N tokens)

run_seconds runs from the first batch dispatched to the last shard committed (startup, i.e. cluster,
actors and model loads, is left out); tokens are the tokens each run generated. 1.0: the wall clock
falls exactly as far as the tokens do; below 1, part of the saving is lost on the way (issue 15's
target: >= 0.85). Each run's actor time breakdown (forward passes, sampling and bookkeeping,
waiting for rewards or for work, Ray calls) says where. With ``--repeats R`` the two builds
alternate R times and the fastest run of each is kept, as in benchmarks.scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

COMPARED = ("best_of_n", "sbon")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=".cache/bench-models",
                        help="bench models (python -m jobs.bench_models --output DIR): generator, reward, prompts.jsonl")
    parser.add_argument("--prompts", type=int, default=24, help="how many of MODELS/prompts.jsonl")
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--decision-token", type=int, default=16, help="sbon's tau")
    parser.add_argument("--rejection-rate", type=float, default=0.875, help="sbon's alpha")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs per strategy; the fastest is kept")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to both builds, e.g. --set runtime.batches_in_flight=4")
    parser.add_argument("--output", default="out/bench/efficiency", help="the builds' outputs: OUTPUT/STRATEGY")
    parser.add_argument("--json", help="write the figures here as JSON")
    return parser.parse_args(argv)


def build(strategy: str, args: argparse.Namespace, prompts: Path) -> dict:
    """One build through the build job; its run report."""
    models, output = Path(args.models), Path(args.output) / strategy
    argv = ["--config", "configs/demo.yaml", "--strategy", strategy, "--prompts", str(prompts),
            "--output", str(output), "--num-samples", str(args.num_samples),
            "--max-new-tokens", str(args.max_new_tokens), "--seed", str(args.seed), "--overwrite", "--no-progress",
            "--set", f"models.generator={models / 'generator'}", "--set", f"models.reward={models / 'reward'}"]
    if strategy == "sbon":
        argv += ["--set", f"strategy.decision_token={args.decision_token}",
                 "--set", f"strategy.rejection_rate={args.rejection_rate}"]
    for override in args.overrides:
        argv += ["--set", override]
    return run_job(strategy, argv, output)


def run_job(strategy: str, argv: list[str], output: Path) -> dict:
    """``jobs.build_dataset`` with ``argv`` (its output ``output``); the build's run report."""
    from jobs.build_dataset import main as build_dataset

    print(f"== {strategy}", flush=True)
    rc = build_dataset(argv)
    if rc != 0:
        raise SystemExit(f"error: the {strategy} build failed (exit code {rc})")
    return json.loads((output / "_report.json").read_text())


def efficiency(bon: dict, sbon: dict) -> dict:
    """The same-run ratios of the two reports."""
    speedup = bon["run_seconds"] / sbon["run_seconds"]
    token_rate = sbon["generated_tokens"] / bon["generated_tokens"]
    return {"speedup": round(speedup, 3), "token_rate": round(token_rate, 3),
            "efficiency": round(speedup * token_rate, 3)}


def compare(lines: list[str], repeats: int, build_one: Callable[[str, Path], dict]) -> tuple[dict, dict, dict]:
    """Both builds on ``lines`` (JSONL prompt rows), ``repeats`` times in alternating order (drift
    on a shared machine hits both): (every run's report by strategy, the fastest of each, their ratios)."""
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text("\n".join(lines) + "\n")
        runs: dict[str, list[dict]] = {s: [] for s in COMPARED}
        for repeat in range(repeats):
            for strategy in COMPARED if repeat % 2 == 0 else COMPARED[::-1]:
                runs[strategy].append(build_one(strategy, prompts))
    best = {s: min(runs[s], key=lambda r: r["run_seconds"]) for s in COMPARED}
    return runs, best, efficiency(best["best_of_n"], best["sbon"])


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
    models = Path(args.models)
    if not (models / "generator").is_dir() or not (models / "reward").is_dir():
        print(f"error: {models}: no bench models (python -m jobs.bench_models --output {models})", file=sys.stderr)
        return 2
    lines = [line for line in (models / "prompts.jsonl").read_text().splitlines() if line.strip()][:args.prompts]
    runs, best, ratios = compare(lines, args.repeats, lambda strategy, prompts: build(strategy, args, prompts))

    print(f"\n{len(lines)} prompts, N={args.num_samples}, T={args.max_new_tokens}, tau={args.decision_token}, "
          f"alpha={args.rejection_rate}, seed {args.seed}" + (f", --set {' '.join(args.overrides)}" if args.overrides
                                                               else "") + f" (fastest of {args.repeats})")
    print_runs(best, ratios)

    if args.json:
        result = {"settings": {k: v for k, v in vars(args).items() if k != "json"}, "prompts": len(lines),
                  **ratios, "runs": best, "all_runs": runs, "cpu_count": os.cpu_count(),
                  "load_average": os.getloadavg()}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
