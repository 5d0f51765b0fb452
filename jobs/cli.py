"""What every job's command line shares: one parser style (every flag with its default), the flags
every job takes (``--log-level``, ``--no-progress``), ``--help-config`` for the jobs that read a
config, the strategy list, and logging.

Flag names are one per meaning across the jobs: --config, --prompts, --prompt-column, --output (where
a job writes), --pairs (a build's output read as input), --generator, --reward, --num-samples,
--max-new-tokens, --seed, --device, --dtype, --set, --log-level, --no-progress.

Ctrl-C (SIGINT) ends any job with one line on stderr, saying what was kept and what a rerun does, and
exit code 130 (``exits_on_interrupt``), never a traceback.

Logging goes to stderr. INFO lines are the message alone ("note: ..." where a note), WARNING and ERROR
lines start "warning: " and "error: " (one line each: the user errors of every job). Where stderr
is not a terminal (``ray job submit``, CI, a log file) a build logs one line per committed shard in
place of its progress bars (pipeline.observability.ShardLog).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import sys
import typing
from typing import Callable

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DTYPES = ("float32", "bfloat16", "float16", "auto")
"""--dtype's values in every job that takes it (models.dtype's)."""
INTERRUPTED = 130
"""A job's exit code after Ctrl-C: 128 + SIGINT's number, what a shell reports for a command SIGINT ended
(1 is a failed shard's, 2 a user error's)."""
log = logging.getLogger(__name__)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description and epilog as written; every flag's default after its help."""

    def _get_help_string(self, action):
        text = action.help or ""
        switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
        if (switch or action.default is None or action.default in ([], "", argparse.SUPPRESS) or "%(default)" in text
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)".strip()


def job_parser(prog: str, doc: str | None, epilog: str | None = None) -> argparse.ArgumentParser:
    """A job's parser: ``prog`` as users type it (the console script), the module docstring's first
    paragraph as the description, and the flags every job takes."""
    description = (doc or "").strip().split("\n\n")[0]
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog, formatter_class=HelpFormatter)
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LEVELS,
                        help="log messages at this level and above on stderr")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (where stderr is not a terminal there are none anyway: a log "
                             "line per step instead)")
    return parser


def interrupted(what: str) -> int:
    """One line on stderr for a job stopped by Ctrl-C (``what``: what was kept, and what a rerun does);
    returns INTERRUPTED, the job's exit code."""
    log.error("interrupted (Ctrl-C): %s", what)
    return INTERRUPTED


def exits_on_interrupt(what: str = "nothing committed; rerun the same command to start again"
                       ) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Decorate a job's ``main``: a KeyboardInterrupt (Ctrl-C, SIGINT) wherever it is raised ends the
    job with ``interrupted(what)`` and exit code 130, not a traceback. A job that can say more (the
    build: how many shards it committed) catches it first, where it knows that."""

    def decorate(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(*args, **kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except KeyboardInterrupt:
                return interrupted(what)

        return run

    return decorate


def bars(args: argparse.Namespace) -> bool:
    """Progress bars for this run: not --no-progress, and stderr is a terminal (elsewhere, under
    ``ray job submit``, CI or a log file, a job logs a line per step instead)."""
    return not args.no_progress and sys.stderr.isatty()


def add_help_config(parser: argparse.ArgumentParser) -> None:
    """``--help-config``: print every config key with its type, default and docstring (generated from
    the config dataclasses, pipeline.config.key_docs) and exit."""

    class HelpConfig(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            from pipeline.config import format_key_docs, key_docs

            try:
                print(format_key_docs(key_docs()))
                sys.stdout.flush()
            except BrokenPipeError:  # `--help-config | head`: the reader has what it wanted
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            parser.exit(0)

    parser.add_argument("--help-config", nargs=0, action=HelpConfig,
                        help="print every config key with its type, default and description, and exit")


def add_device_flags(parser: argparse.ArgumentParser) -> None:
    """--device and --dtype, for the jobs that load the generator and the reward model themselves
    (the build jobs take models.device / models.dtype from the config)."""
    parser.add_argument("--device", default="cpu", help="torch device of both models (cpu, cuda, cuda:1, ...)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="torch dtype of both models (auto: the checkpoints' own)")


def add_channel_objective_flags(parser: argparse.ArgumentParser) -> None:
    """--objective, --mc-weight and --td-weight: the Reward Transformer channel's training loss
    (pipeline.training.reward_channel.channel_loss). The choices are reward_channel.OBJECTIVES,
    spelt out so that --help does not load torch (tests/test_reward_transformer.py holds them equal)."""
    parser.add_argument("--objective", choices=("sla", "tcrm"), default="sla",
                        help="sla: Eq. 17, the mean token reward's Bradley-Terry; tcrm: Bradley-Terry at the last token "
                             "plus TCRM's terms, every token's reward regressed on the final and on the next one's")
    for name, term in (("mc", "Monte Carlo"), ("td", "temporal-difference")):
        parser.add_argument(f"--{name}-weight", type=float, default=1.0, metavar="W",
                            help=f"with --objective tcrm: the {term} term's weight (>= 0)")


def channel_objective_error(args: argparse.Namespace) -> str | None:
    """The one-line complaint about add_channel_objective_flags' values, or None."""
    for flag in ("mc_weight", "td_weight"):
        if getattr(args, flag) < 0:
            return f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}"
    return None


def strategies_text() -> str:
    """The strategies of the method registry, one per line: name, aliases, backends, summary."""
    from pipeline.strategies import STRATEGIES

    lines = ["strategies (strategy.name / --strategy):"]
    for record in STRATEGIES.values():
        aliases = f" (alias {', '.join(record.aliases)})" if record.aliases else ""
        backends = ", ".join(sorted(record.backends))
        lines.append(f"  {record.name:<10} {record.summary}{aliases}; backends: {backends}")
    return "\n".join(lines)


class _Stderr(logging.StreamHandler):
    """A handler that writes to whatever ``sys.stderr`` is at each record (pytest's capture, a
    redirected stream), not the one it was created with."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


class _Formatter(logging.Formatter):
    PREFIX = {logging.DEBUG: "debug: ", logging.WARNING: "warning: ", logging.ERROR: "error: ",
              logging.CRITICAL: "error: "}

    def format(self, record: logging.LogRecord) -> str:
        return self.PREFIX.get(record.levelno, "") + super().format(record)


OURS = ("pipeline", "actors", "jobs", "benchmarks", "__main__")


def setup_logging(level: str = "INFO") -> None:
    """Log records of our packages at ``level`` and above to stderr (one handler, installed once; a
    later call changes the level). Other libraries' records pass at WARNING and above only (a
    library that sets its own logger to INFO, such as werkzeug's request log, stays quiet), all of
    them at DEBUG."""
    root = logging.getLogger()
    handler = next((h for h in root.handlers if isinstance(h, _Stderr)), None)
    if handler is None:
        handler = _Stderr()
        handler.setFormatter(_Formatter("%(message)s"))
        root.addHandler(handler)
    debug = level == "DEBUG"
    handler.filters = [lambda record: debug or record.levelno >= logging.WARNING
                       or record.name.split(".")[0] in OURS]
    root.setLevel(logging.DEBUG if debug else logging.WARNING)
    for ours in OURS:
        logging.getLogger(ours).setLevel(level)


def add_settings_flags(parser: argparse.ArgumentParser, settings_class: type, prefix: str = "") -> None:
    """A flag for each field of the dataclass ``settings_class`` whose metadata has a "help":
    --PREFIXNAME (underscores as dashes; its dest PREFIXNAME), of the field's type and default,
    with the metadata's "choices"; a list field takes one value or more, a bool field is --NAME /
    --no-NAME. ``settings_from_flags`` reads them back."""
    defaults, types = settings_class(), typing.get_type_hints(settings_class)
    for f in dataclasses.fields(settings_class):
        if "help" not in f.metadata:
            continue
        kind, options = types[f.name], {"default": getattr(defaults, f.name), "help": f.metadata["help"]}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is list:
            options.update(type=typing.get_args(kind)[0], nargs="+")
        else:
            options.update(type=kind, choices=f.metadata.get("choices"))
        parser.add_argument("--" + (prefix + f.name).replace("_", "-"), dest=prefix + f.name, **options)


def settings_from_flags(settings_class: type, args: argparse.Namespace, prefix: str = "", **given):
    """The ``settings_class`` the flags of ``add_settings_flags`` ask for; ``given`` sets other fields."""
    flags = {f.name: getattr(args, prefix + f.name) for f in dataclasses.fields(settings_class) if "help" in f.metadata}
    return settings_class(**{**flags, **given})
