"""Build a preference dataset: prompts in, chosen/rejected Parquet out.

    python -m jobs.build_dataset --config FILE [--prompts URI] [--output URI] [--strategy NAME]
        [--num-samples N] [--max-new-tokens T] [--seed S] [--set dotted.key=value ...]

With no Ray address it starts a local cluster; under `ray job submit` or with RAY_ADDRESS set it
attaches. `--set runtime.local=true` runs everything in-process without Ray. User errors (bad
config, missing or unreadable input) print one line on stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys

from pipeline.config import ConfigError, load_config
from pipeline.data.prompts import InputError

FLAG_KEYS = {"prompts": "data.prompts", "output": "data.output",
             "num_samples": "sampling.num_samples", "max_new_tokens": "sampling.max_new_tokens", "seed": "seed"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobs.build_dataset", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    for flag, key in FLAG_KEYS.items():
        parser.add_argument(f"--{flag.replace('_', '-')}", dest=flag, help=f"shortcut for --set {key}=...")
    parser.add_argument("--strategy", help="decoding method (keeps the config's parameters it takes)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key, e.g. --set strategy.rejection_rate=0.7")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = [f"{key}={getattr(args, flag)}" for flag, key in FLAG_KEYS.items() if getattr(args, flag) is not None]
    try:
        config = load_config(args.config, overrides + args.overrides, strategy=args.strategy)
        for key in ("prompts", "output"):
            if not getattr(config.data, key):
                raise ConfigError(f"data.{key}: not set (use --{key} or the config file)")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from actors import start_workers
    from pipeline.build import format_summary, plan_build, run_build

    try:
        plan = plan_build(config)  # every input error surfaces here, before a cluster starts
    except (ConfigError, InputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    workers = start_workers(config)
    try:
        manifest = run_build(plan, workers, progress=not args.no_progress)
    finally:
        workers.shutdown()
    print(format_summary(manifest))
    print(f"output: {config.data.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
