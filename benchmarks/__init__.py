"""Benchmarks: each script measures one thing side by side in one run and prints ratios.

This module is what the scripts share, so that each one holds only what it measures:

- ``bench_parser``: the jobs' parser (jobs.cli.job_parser) with the canonical flags a benchmark
  names (--config, --strategy, --models, --generator, --reward, --prompts, --num-prompts,
  --num-samples, --max-new-tokens, --seed, --device, --dtype, --threads, --repeats, --set, --output,
  --json, --plot), each meaning what it means in the jobs; ``parse`` reads the command line and
  records it;
- ``model_dirs``: the model sets (tiny, bench, real, or a directory), built where that is cheap;
- ``read_prompts`` / ``write_prompts``: the one JSONL prompt loader, and the file a build reads;
- ``side_by_side`` / ``fastest`` / ``ratio_table``: named variants run alternately in one process
  (``run_job``: one through jobs.build_dataset), timed, and their ratios to a baseline;
- ``write_json`` (the figures with the environment: date, commit, packages, machine, command line)
  and ``write_png`` (matplotlib, the ``plots`` extra).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from jobs.cli import job_parser, setup_logging

FLAGS = {
    "config": dict(help="YAML config of the builds (every key: bon-build --help-config)"),
    "strategy": dict(help="decoding strategy, a name of pipeline.strategies (bon-build --help lists them)"),
    "models": dict(help="model set: tiny (jobs.make_tiny_models, built into .cache/tiny-models when missing), bench "
                        "(jobs.bench_models, .cache/bench-models, built when missing: about 10 minutes), real "
                        "(jobs.fetch_models, .cache/real-models: make real-models), or a directory holding "
                        "generator/, reward/, draft/"),
    "generator": dict(help="generator model directory (default: the model set's)"),
    "reward": dict(help="reward model directory, or a reward function module:function (default: the model set's)"),
    "prompts": dict(help="prompt file: JSONL with a prompt field"),
    "num_prompts": dict(type=int, help="how many prompts (the first ones)"),
    "num_samples": dict(type=int, help="candidates per prompt (N)"),
    "max_new_tokens": dict(type=int, help="new tokens per candidate (T)"),
    "seed": dict(type=int, help="seed of every sampler"),
    "device": dict(help="torch device of the models (cpu, cuda, cuda:1, ...)"),
    "dtype": dict(choices=("float32", "bfloat16", "float16", "auto"), help="torch dtype of the models"),
    "threads": dict(type=int, help="torch CPU threads"),
    "repeats": dict(type=int, help="timed runs per variant, alternating; the fastest is kept"),
    "set": dict(dest="overrides", action="append", metavar="KEY=VALUE",
                help="config override passed to every build (repeatable)"),
    "output": dict(help="where the builds write: OUTPUT/VARIANT"),
    "json": dict(help="write the figures here (JSON, with the environment they were measured in)"),
    "plot": dict(help="write the figure here (PNG; needs the plots extra)"),
}
"""The canonical flags: argparse settings by destination name; a benchmark names the ones it takes."""

MODEL_SETS = {"tiny": Path(".cache/tiny-models"), "bench": Path(".cache/bench-models"),
              "real": Path(".cache/real-models")}
"""Where each named model set lives (the Makefile's TINY_MODELS, BENCH_MODELS, REAL_MODELS)."""



def bench_parser(module: str, doc: str | None, **flags) -> argparse.ArgumentParser:
    """The parser of ``python -m module``: the jobs' own (the docstring's first paragraph, --log-level,
    --no-progress) plus the canonical flags named in ``flags``, in that order. Each value is the
    flag's default, or a dict of argparse settings that replace the canonical ones (``default``
    among them). The benchmark adds its own flags to what this returns."""
    parser = job_parser(f"python -m {module}", doc)
    for name, value in flags.items():
        settings = {**FLAGS[name], **(value if isinstance(value, dict) else {"default": value})}
        parser.add_argument(f"--{name.replace('_', '-')}", **settings)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The parsed arguments, with ``command``: the command line as typed, credentials redacted (for
    ``write_json``);
    logging set to --log-level, and torch's CPU threads to --threads where the script takes it."""
    args = parser.parse_args(argv)
    from pipeline.provenance import redact

    args.command = f"{parser.prog} {shlex.join(redact(sys.argv[1:] if argv is None else list(argv)))}".strip()
    setup_logging(args.log_level)
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    return args


def fail(message: str):
    """Bad input: one line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


# --- models ------------------------------------------------------------------------------------


def model_dirs(source: str, roles: tuple[str, ...] = ("generator", "reward"), seed: int = 0,
               **given: str | None) -> dict[str, str]:
    """The model of each role (generator, reward, draft): ``given[role]`` where given, else
    SET/role of the model set ``source``: tiny (jobs.make_tiny_models with ``seed``, built into
    .cache/tiny-models, or tiny-models-seedS, when missing), bench (jobs.bench_models, built when
    missing and cached), real (jobs.fetch_models; missing: exit 2 naming ``make real-models``), or a
    directory holding the roles (missing: exit 2)."""
    root = MODEL_SETS.get(source, Path(source))
    if source == "tiny" and seed:
        root = root.with_name(f"{root.name}-seed{seed}")
    missing = [r for r in roles if not given.get(r) and not (root / r / "config.json").exists()]
    if missing and source == "tiny":
        from jobs.make_tiny_models import make_tiny_models

        staging = root.with_name(f"{root.name}.tmp-{os.getpid()}")
        make_tiny_models(staging, seed=seed)
        shutil.rmtree(root, ignore_errors=True)
        staging.rename(root)
    elif missing and source == "bench":
        from jobs.bench_models import make_bench_models

        print(f"building the bench models in {root} (cached afterwards)", file=sys.stderr)
        make_bench_models(root)
    elif missing:
        fail(f"{root / missing[0]}: no model directory"
             + (" (make real-models)" if source == "real" else f" (--models DIR holds {', '.join(roles)})"))
    return {r: str(given.get(r) or root / r) for r in roles}


# --- prompts -----------------------------------------------------------------------------------


def model_prompts(source: str) -> str:
    """The prompt file that goes with a model set: its own prompts.jsonl (the bench models'), else
    the demo's prompts."""
    own = MODEL_SETS.get(source, Path(source)) / "prompts.jsonl"
    return str(own) if own.exists() else "configs/prompts/demo.jsonl"


def read_prompts(path: str, count: int | None = None, exactly: bool = False) -> list[dict]:
    """The first ``count`` rows (all without it) of a JSONL prompt file that have a "prompt" string,
    each row whole (IFEval's instruction columns and any other kept). A row without one, an
    unreadable file or, with ``exactly``, fewer rows: one line naming the file (and row), exit 2."""
    rows = []
    try:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if len(rows) == count:
                    break
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    if not isinstance(row["prompt"], str):
                        raise TypeError(f"prompt is a {type(row['prompt']).__name__}")
                except (ValueError, KeyError, TypeError) as e:
                    fail(f"{path}: row {number}: no \"prompt\" string ({e})")
                rows.append(row)
    except OSError as e:
        fail(f"{path}: {e.strerror}")
    if exactly and count is not None and len(rows) < count:
        fail(f"{path}: {len(rows)} prompts, {count} asked for")
    return rows


def write_prompts(rows: list[dict], path: Path) -> Path:
    """``rows`` as the JSONL prompt file a build reads."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# --- run and compare ---------------------------------------------------------------------------


@dataclass
class Run:
    """One timed run of a variant."""

    value: Any
    """What the variant returned."""
    seconds: float
    """Wall-clock seconds."""
    cpu_seconds: float
    """CPU seconds of this process: the work itself, which other processes on a shared machine do
    not inflate (a Ray actor's or a subprocess's work is not in it)."""


def side_by_side(variants: dict[str, Callable[[], Any]], repeats: int = 1,
                 sync: Callable[[], None] = lambda: None) -> dict[str, list[Run]]:
    """Every variant ``repeats`` times, in one process, the order reversed every other round so that
    drift on a shared machine hits all alike; each run timed (``sync``, e.g. torch.cuda.synchronize,
    before each clock read). Warm-up is the caller's: run what it needs before."""
    runs: dict[str, list[Run]] = {name: [] for name in variants}
    for repeat in range(repeats):
        for name in list(variants) if repeat % 2 == 0 else list(variants)[::-1]:
            sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            value = variants[name]()
            sync()
            runs[name].append(Run(value, time.perf_counter() - start, time.process_time() - start_cpu))
    return runs


def fastest(runs: dict[str, list[Run]], seconds: Callable[[Run], float] = lambda run: run.seconds) -> dict[str, Run]:
    """Each variant's fastest run by ``seconds`` (a build's: its report's run_seconds): noise only adds time."""
    return {name: min(each, key=seconds) for name, each in runs.items()}


def ratio_table(figures: dict[str, float], baseline: str, figure: str,
                higher_is_better: bool = False) -> dict[str, float]:
    """One line per variant: its ``figure`` and its ratio to ``baseline``'s, oriented so that above 1
    is better (the baseline's seconds over the variant's; the variant's rate over the baseline's).
    Returns the ratios."""
    base = figures[baseline]
    ratios = {name: round((value / base) if higher_is_better else (base / value), 3) for name, value in figures.items()}
    width = max(len(name) for name in figures) + 2
    print(f"{'':<{width}}{figure:>14}  {'x ' + baseline:>{len(baseline) + 2}}")
    for name, value in figures.items():
        print(f"{name:<{width}}{value:>14.3f}  {ratios[name]:>{len(baseline) + 2}.3f}")
    return ratios


def job_argv(config: str, strategy: str, prompts: Path | str, output: Path, overrides: list[str],
             overwrite: bool = True) -> list[str]:
    """The build job's command line for one variant: ``overrides`` as --set, in order."""
    argv = ["--config", config, "--strategy", strategy, "--prompts", str(prompts), "--output", str(output),
            *(["--overwrite"] if overwrite else []), "--no-progress"]
    for override in overrides:
        argv += ["--set", override]
    return argv


def run_job(name: str, argv: list[str], output: Path) -> dict:
    """``jobs.build_dataset`` with ``argv`` (its output ``output``): the build's run report
    (_report.json: run_seconds from the first batch dispatched to the last shard committed)."""
    from jobs.build_dataset import main as build_dataset

    print(f"== {name}", flush=True)
    rc = build_dataset(argv)
    if rc != 0:
        raise SystemExit(f"error: the {name} build failed (exit code {rc})")
    return json.loads((Path(output) / "_report.json").read_text())


# --- output ------------------------------------------------------------------------------------


def environment(command: str | None = None) -> dict:
    """Where a result was measured: date (UTC), git commit (``+dirty`` with uncommitted changes) and
    package versions as a build's provenance records them (pipeline.provenance), machine (platform,
    CPUs, load average, GPU) and the command line."""
    from pipeline.provenance import git_commit, package_versions

    commit = git_commit()
    if commit:
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        commit += "+dirty" if dirty else ""
    machine = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
               "load_average": [round(v, 2) for v in os.getloadavg()]}
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        machine["gpu"] = sys.modules["torch"].cuda.get_device_name(0)
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "git_commit": commit, "packages": {k: v for k, v in package_versions().items() if v is not None},
            "machine": machine, "command": command}


def write_json(path: str | None, figures: dict, args: argparse.Namespace | None = None) -> None:
    """``figures`` and the environment (``args.command`` as the command line) as JSON at ``path``
    (nothing without one)."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    record = {**figures, "environment": environment(getattr(args, "command", None))}
    Path(path).write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"wrote {path}")


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, for a script's PNG; where matplotlib is not
    installed (it is the ``plots`` extra), one line on stderr and exit code 2."""
    try:
        import matplotlib
    except ImportError:
        print("error: the plots need matplotlib: pip install 'bon-pipeline[plots]'", file=sys.stderr)
        raise SystemExit(2) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_png(path: str | None, draw: Callable[[Any], Any], dpi: int = 120) -> None:
    """The figure ``draw(pyplot)`` returns, as a PNG at ``path`` (nothing without one)."""
    if not path:
        return
    plt = pyplot()
    fig = draw(plt)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    print(f"wrote {path}")
