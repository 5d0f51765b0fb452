"""The driver's peak memory against the input's row count: planning, and the whole build.

    python -m benchmarks.input_memory [--rows 10000,100000,1000000] [--formats jsonl,parquet]
        [--phases plan,build] [--shard-size 64] [--num-samples 2] [--max-new-tokens 4]
        [--time-scale 0] [--generators 2] [--rewards 1] [--workdir DIR] [--json FILE]

Writes a JSONL and a Parquet input of each row count (one row in 50 a duplicate of a row far
earlier, one in 100 blank, one in 100 without a prompt: the rejects the build records), then runs
each case in a fresh process and reads that process's resident set size from the kernel
(/proc/self/status): ``baseline`` once the imports are done and the tokenizer is loaded, ``plan``
the high-water mark while pipeline.build.plan_build runs, ``build`` the high-water mark of
plan_build followed by run_build (the peak is reset, through /proc/self/clear_refs, after the
baseline is taken). ``growth`` is the peak less the baseline: what the input costs the driver.
The ratio printed is the largest row count's over the smallest's.

The build is the real one (reader, validation, shards, coordinator, pair selection, commits,
markers, manifest) over the simulated actors of benchmarks.cluster_sim (Cost, SimGenerator,
SimScorer) with every simulated forward pass scaled by ``--time-scale`` (0: no sleeps, the
driver runs as fast as it can), best_of_n with ``--num-samples`` candidates per prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import bench_parser, parse, write_json
from benchmarks.cluster_sim import parse_args as parse_sim_args

DUPLICATE_EVERY = 50
"""Row i with i % 50 == 49 repeats the prompt of row i // 2 (a row far earlier, often many shards back)."""
BLANK_EVERY, MISSING_EVERY = 100, 100
"""Row i with i % 100 == 17 is blank; with i % 100 == 71 has no prompt (JSONL: no key; Parquet: null)."""
PARQUET_ROW_GROUP = 10_000
"""Rows per Parquet row group: the reader holds one row group's prompt column at a time."""


def prompt_of(i: int) -> str | None:
    if i % DUPLICATE_EVERY == DUPLICATE_EVERY - 1:
        return prompt_of(i // 2)
    if i % BLANK_EVERY == 17:
        return "   "
    if i % MISSING_EVERY == 71:
        return None
    return f"Question {i}: explain topic {i * 7919 % 100003} in a few plain sentences for a new reader."


def write_inputs(rows: int, workdir: Path) -> dict[str, Path]:
    """The JSONL and the Parquet input of ``rows`` rows (written once, chunk by chunk)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {"jsonl": workdir / f"prompts-{rows}.jsonl", "parquet": workdir / f"prompts-{rows}.parquet"}
    if not paths["jsonl"].exists():
        tmp = paths["jsonl"].with_suffix(".tmp")
        with open(tmp, "w") as f:
            for i in range(rows):
                value = prompt_of(i)
                f.write(json.dumps({"id": i} if value is None else {"id": i, "prompt": value}) + "\n")
        tmp.rename(paths["jsonl"])
    if not paths["parquet"].exists():
        tmp = paths["parquet"].with_suffix(".tmp")
        schema = pa.schema([("id", pa.int64()), ("prompt", pa.string())])
        with pq.ParquetWriter(tmp, schema) as writer:
            for start in range(0, rows, PARQUET_ROW_GROUP):
                ids = list(range(start, min(rows, start + PARQUET_ROW_GROUP)))
                writer.write_table(pa.table({"id": ids, "prompt": [prompt_of(i) for i in ids]}, schema))
        tmp.rename(paths["parquet"])
    return paths


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS (VmHWM) to the current RSS
        f.write("5")


def sim_workers(generators: int, rewards: int, time_scale: float = 0.0):
    """benchmarks.cluster_sim's simulated actors at its default costs, every sleep x ``time_scale``,
    as runtime.local builds its handles."""
    from actors.factory import Workers, local_generator, local_scorer
    from benchmarks.cluster_sim import Cost, SimGenerator, SimScorer

    defaults = parse_sim_args([])
    cost = Cost(argparse.Namespace(**{**vars(defaults), "time_scale": time_scale}))
    return Workers([local_generator(SimGenerator(cost)) for _ in range(generators)],
                   [local_scorer(SimScorer(cost)) for _ in range(rewards)])


def measure(args: argparse.Namespace, input_path: Path, output: Path, phases: list[str]) -> dict:
    """One case, in this process: baseline, planning peak and (with "build") the whole build's peak."""
    from pipeline.build import plan_build, run_build
    from pipeline.config import load_config
    from pipeline.engines.hf import load_tokenizer
    from transformers import AutoConfig

    overrides = {
        "models.generator": args.tokenizer, "models.reward": args.tokenizer, "models.draft": "",
        "sampling.num_samples": args.num_samples, "sampling.max_new_tokens": args.max_new_tokens,
        "data.prompts": str(input_path), "data.output": str(output), "data.shard_size": args.shard_size,
        "runtime.local": "true", "runtime.generator_actors": args.generators, "runtime.reward_actors": args.rewards,
    }
    config = load_config("configs/demo.yaml", [f"{key}={value}" for key, value in overrides.items()],
                         strategy="best_of_n")
    load_tokenizer(args.tokenizer), AutoConfig.from_pretrained(args.tokenizer)  # loaded before the baseline
    _reset_peak()
    baseline = _status_kib("VmRSS")
    wall, cpu = time.perf_counter(), time.process_time()
    plan = plan_build(config, overwrite=True)
    result = {"rows": plan.prompts_in, "baseline_mib": baseline / 1024, "plan_peak_mib": _status_kib("VmHWM") / 1024,
              "plan_seconds": time.perf_counter() - wall, "plan_cpu_seconds": time.process_time() - cpu}
    if "build" in phases:
        manifest = run_build(plan, sim_workers(args.generators, args.rewards, args.time_scale), progress=False)
        result.update(build_peak_mib=_status_kib("VmHWM") / 1024, build_seconds=time.perf_counter() - wall,
                      build_cpu_seconds=time.process_time() - cpu, pairs=manifest["pairs"],
                      rejected=manifest["prompts_rejected"], reject_reasons=manifest["reject_reasons"])
    result["maxrss_mib"] = _maxrss_kib() / 1024
    return result


def _maxrss_kib() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = bench_parser("benchmarks.input_memory", __doc__, num_samples=2, max_new_tokens=4, json=None)
    parser.add_argument("--rows", default="10000,100000,1000000", help="comma-separated row counts")
    parser.add_argument("--formats", default="jsonl,parquet")
    parser.add_argument("--phases", default="plan,build", help="plan: planning only; build: plan and run")
    parser.add_argument("--shard-size", type=int, default=64)
    parser.add_argument("--time-scale", type=float, default=0.0, help="every simulated forward pass x this")
    parser.add_argument("--generators", type=int, default=2)
    parser.add_argument("--rewards", type=int, default=1)
    parser.add_argument("--tokenizer", default=".cache/tiny-models/generator",
                        help="the build plans with a real tokenizer (python -m jobs.make_tiny_models)")
    parser.add_argument("--workdir", help="where the inputs are written and kept (default: a temporary directory)")
    parser.add_argument("--in-process", action="store_true",
                        help="run the one case (one --rows, one --formats) in this process, e.g. under /usr/bin/time -v")
    return parse(parser, argv)


def _run_case(args: argparse.Namespace, rows: int, fmt: str, workdir: Path) -> dict:
    """One case in a fresh process, so that each peak is that case's alone."""
    command = [sys.executable, "-m", "benchmarks.input_memory", "--in-process", "--rows", str(rows), "--formats", fmt,
               "--workdir", str(workdir), "--json", str(workdir / f"case-{fmt}-{rows}.json")]
    for flag in ("phases", "shard_size", "num_samples", "max_new_tokens", "time_scale", "generators", "rewards",
                 "tokenizer"):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads((workdir / f"case-{fmt}-{rows}.json").read_text())["results"][0]


def _print_table(results: list[dict], phases: list[str]) -> None:
    columns = [("baseline_mib", "baseline"), ("plan_peak_mib", "plan peak")]
    if "build" in phases:
        columns.append(("build_peak_mib", "build peak"))
    print(f"{'format':<8}{'rows':>10}" + "".join(f"{title:>13}" for _, title in columns)
          + f"{'plan growth':>13}" + (f"{'build growth':>14}{'build s':>9}" if "build" in phases else ""))
    for r in results:
        line = f"{r['format']:<8}{r['rows']:>10,}" + "".join(f"{r[key]:>10.1f} MiB" for key, _ in columns)
        line += f"{r['plan_peak_mib'] - r['baseline_mib']:>10.1f} MiB"
        if "build" in phases:
            line += f"{r['build_peak_mib'] - r['baseline_mib']:>11.1f} MiB{r['build_seconds']:>9.0f}"
        print(line)
    for fmt in sorted({r["format"] for r in results}):
        runs = sorted((r for r in results if r["format"] == fmt), key=lambda r: r["rows"])
        if len(runs) < 2:
            continue
        small, large = runs[0], runs[-1]
        for phase in ("plan", "build") if "build" in phases else ("plan",):
            peak = f"{phase}_peak_mib"
            print(f"{fmt} {phase}: peak {large['rows']:,} rows / {small['rows']:,} rows = "
                  f"{large[peak] / small[peak]:.2f}; growth over the baseline "
                  f"{large[peak] - large['baseline_mib']:.1f} / {small[peak] - small['baseline_mib']:.1f} MiB")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (Path(args.tokenizer) / "tokenizer_config.json").exists():
        print(f"error: {args.tokenizer}: no tokenizer (python -m jobs.make_tiny_models --output "
              f"{Path(args.tokenizer).parent})", file=sys.stderr)
        return 2
    rows = [int(r) for r in args.rows.split(",")]
    formats = args.formats.split(",")
    phases = args.phases.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if args.in_process:
            if len(rows) != 1 or len(formats) != 1:
                print("error: --in-process runs one case: one --rows and one --formats", file=sys.stderr)
                return 2
            output = workdir / f"out-{os.getpid()}"
            try:
                result = measure(args, write_inputs(rows[0], workdir)[formats[0]], output, phases)
            finally:
                shutil.rmtree(output, ignore_errors=True)
            result["format"] = formats[0]
            results = [result]
        else:
            results = []
            for n in rows:
                write_inputs(n, workdir)
                for fmt in formats:
                    results.append({**_run_case(args, n, fmt, workdir), "format": fmt})
                    print(json.dumps(results[-1]), flush=True)
        _print_table(results, phases)
    write_json(args.json, {"settings": vars(args), "results": results}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
