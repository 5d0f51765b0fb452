"""Build a preference dataset: prompts in, chosen/rejected Parquet out (a dataset TRL's DPOTrainer
and datasets.load_dataset read as it is).

    bon-build --config FILE [--prompts URI] [--output URI] [--strategy NAME]
        [--num-samples N] [--max-new-tokens T] [--seed S] [--set dotted.key=value ...] [--overwrite]
    (or python -m jobs.build_dataset ...)

With no Ray address it starts a local cluster; under `ray job submit` or with RAY_ADDRESS set it
attaches. `--set runtime.local=true` runs everything in-process without Ray. User errors (bad
config, missing or unreadable input, an output that holds a build of another config or that
another build is writing) print one line on stderr and exit with code 2. A rerun into the same
output resumes: committed shards are skipped. A shard that still fails after
runtime.max_attempts exits with code 1, naming the shard.
"""

from __future__ import annotations

import argparse
import logging
import sys

from jobs.cli import add_help_config, job_parser, setup_logging, strategies_text
from pipeline.config import ConfigError, key_docs, load_config
from pipeline.errors import InputError
from pipeline.errors import OutputConflict

log = logging.getLogger(__name__)
FLAG_KEYS = {"prompts": "data.prompts", "output": "data.output",
             "num_samples": "sampling.num_samples", "max_new_tokens": "sampling.max_new_tokens", "seed": "seed"}
EXIT_CODES = ("exit codes: 0 built (or already built); 1 a shard failed after runtime.max_attempts (rerun to "
              "resume);\n  2 a user error (config, input, output, models), one line on stderr")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = {d.key: d.default for d in key_docs()}
    parser = job_parser("bon-build", __doc__, epilog=f"{strategies_text()}\n\nEvery config key: bon-build "
                        f"--help-config. Any key: --set KEY=VALUE.\n{EXIT_CODES}")
    add_help_config(parser)
    parser.add_argument("--config", required=True, help="YAML config (see configs/; every key: --help-config)")
    for flag, key in FLAG_KEYS.items():
        shown = defaults[key] if defaults[key] != "" else "none"
        parser.add_argument(f"--{flag.replace('_', '-')}", dest=flag,
                            help=f"shortcut for --set {key}=... (default: the config's, else {shown})")
    parser.add_argument("--strategy", help="decoding method, from the list below (keeps the config's parameters "
                                           "it takes; default: the config's strategy.name, else sbon)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key, e.g. --set strategy.rejection_rate=0.7 (repeatable)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an output built with another config (default: refuse; same config resumes)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level)
    overrides = [f"{key}={getattr(args, flag)}" for flag, key in FLAG_KEYS.items() if getattr(args, flag) is not None]
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
    try:
        workers = start_workers(config)
        try:
            manifest = run_build(plan, workers, progress=not args.no_progress)
        finally:
            workers.shutdown()
    except ShardFailed as exc:  # a shard out of retries: loud, named, and resumable
        log.error("%s", exc)
        return 1
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
