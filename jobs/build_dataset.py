"""Build a preference dataset: prompts in, chosen/rejected Parquet out (a dataset TRL's DPOTrainer
and datasets.load_dataset read as it is).

    bon-build [--config FILE] [--prompts URI] [--output URI] [--strategy NAME] [--generator DIR]
        [--reward DIR ...] [--device cpu|cuda] [--dtype float32] [--prompt-column NAME]
        [--num-samples N] [--max-new-tokens T] [--seed S] [--set dotted.key=value ...] [--overwrite]
    (or python -m jobs.build_dataset ...)

Without --config every key has its default (bon-build --help-config); a flag or --set sets one.

With no Ray address it starts a local cluster; under `ray job submit` or with RAY_ADDRESS set it
attaches. `--set runtime.local=true` runs everything in-process without Ray. User errors (bad
config, missing or unreadable input, an output that holds a build of another config or that
another build is writing) print one line on stderr and exit with code 2. A rerun into the same
output resumes: committed shards are skipped. A shard that still fails after
runtime.max_attempts exits with code 1, naming the shard. Ctrl-C exits with code 130 and one line
saying how many shards are committed: a rerun resumes from there.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from jobs.cli import (DTYPES, add_help_config, exits_on_interrupt, interrupted, job_parser, setup_logging,
                      strategies_text)
from pipeline.config import ConfigError, key_docs, load_config
from pipeline.errors import InputError
from pipeline.errors import OutputConflict

log = logging.getLogger(__name__)
FLAG_KEYS = {"prompts": "data.prompts", "output": "data.output", "generator": "models.generator",
             "reward": "models.reward", "device": "models.device", "dtype": "models.dtype",
             "prompt_column": "data.prompt_column", "num_samples": "sampling.num_samples",
             "max_new_tokens": "sampling.max_new_tokens", "seed": "seed"}
"""Each shortcut flag's config key: the flags the other jobs take under the same names."""
TEXT_FLAGS = {"generator", "reward", "device", "dtype", "prompt_column"}
"""Shortcuts whose value is text, never YAML (a model directory named ``true`` or ``1e3`` stays a name)."""
EXIT_CODES = ("exit codes: 0 built (or already built); 1 a shard failed after runtime.max_attempts (rerun to "
              "resume);\n  2 a user error (config, input, output, models), one line on stderr; 130 interrupted "
              "(Ctrl-C; rerun to resume)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = {d.key: d.default for d in key_docs()}
    parser = job_parser("bon-build", __doc__, epilog=f"{strategies_text()}\n\nEvery config key: bon-build "
                        f"--help-config. Any key: --set KEY=VALUE.\n{EXIT_CODES}")
    add_help_config(parser)
    parser.add_argument("--config", help="YAML config (see configs/; every key: --help-config; default: none, "
                                         "every key its default)")
    for flag, key in FLAG_KEYS.items():
        shown = defaults[key] if defaults[key] not in ("", None, []) else "none"
        options = {"nargs": "+", "metavar": "MODEL"} if flag == "reward" else {}  # several: a composite reward
        if flag == "dtype":
            options["choices"] = DTYPES
        parser.add_argument(f"--{flag.replace('_', '-')}", dest=flag, **options,
                            help=f"shortcut for --set {key}=... (default: the config's, else {shown})")
    parser.add_argument("--strategy", help="decoding method, from the list below (keeps the config's parameters "
                                           "it takes; default: the config's strategy.name, else sbon)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key, e.g. --set strategy.rejection_rate=0.7 (repeatable)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an output built with another config (default: refuse; same config resumes)")
    return parser.parse_args(argv)


def shortcut(flag: str, value) -> str:
    """The --set item of shortcut ``flag``'s value."""
    if flag == "reward":
        value = value[0] if len(value) == 1 else value
    return f"{FLAG_KEYS[flag]}={json.dumps(value) if flag in TEXT_FLAGS else value}"


@exits_on_interrupt("committed shards are kept; rerun the same command to resume")
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level)
    overrides = [shortcut(flag, getattr(args, flag)) for flag in FLAG_KEYS if getattr(args, flag) is not None]
    try:
        config = load_config(args.config, overrides + args.overrides, strategy=args.strategy)
        for key in ("prompts", "output"):
            if not getattr(config.data, key):
                raise ConfigError(f"data.{key}: not set (use --{key} or the config file)")
    except ConfigError as exc:
        log.error("%s", exc)
        return 2

    from actors import start_workers
    from pipeline.build import format_summary, plan_build, run_build
    from pipeline.errors import ShardFailed

    try:
        plan = plan_build(config, overwrite=args.overwrite)  # input and output errors surface before a cluster starts
    except (ConfigError, InputError, OutputConflict) as exc:
        log.error("%s", exc)
        return 2
    if plan.prompts_in == 0:
        # An empty build's output is no dataset (load_dataset finds no pair file): say so, build nothing.
        plan.first_rows.close()
        plan.store.release_lease()
        log.error("%s: no rows (an empty input); nothing to build", config.data.prompts)
        return 2
    try:
        workers = start_workers(config)
        try:
            manifest = run_build(plan, workers, progress=not args.no_progress)
        finally:
            workers.shutdown()
    except ShardFailed as exc:  # a shard out of retries: loud, named, and resumable
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        committed = sum(1 for _ in plan.store.iter_markers())
        return interrupted(f"{committed} of {plan.num_shards} shards committed to {config.data.output}; rerun the "
                           "same command to resume from there")
    except (ConfigError, InputError, OutputConflict) as exc:
        # Actors the cluster cannot hold (actors.factory: checked once the cluster is up); the input,
        # read again shard by shard, changed or became unreadable; or the output's lease was lost, or
        # another config's shards turned up in it (verify).
        log.error("%s", exc)
        return 2
    finally:
        plan.store.release_lease()  # run_build releases it too; this covers workers that never started
    print(format_summary(manifest))
    print(f"output: {config.data.output}  (dataset card: README.md; run report: _report.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
