"""Every job's command line (jobs.cli): one parser style, `--help` with the right program name and
every default, `--log-level` taken and applied first, one name per flag across the jobs,
`--help-config` generated from the config dataclasses, and the strategies of the registry listed.
Parsers only: nothing loads a model."""

import argparse
import importlib
import logging
import pkgutil
import tomllib
from pathlib import Path

import pytest

import jobs
from jobs.cli import setup_logging
from pipeline.config import key_docs
from pipeline.strategies import STRATEGIES

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = {target.split(":")[0]: name
           for name, target in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"].items()}
"""Job module -> its console script (pyproject.toml)."""
JOBS = sorted(m.name for m in pkgutil.iter_modules(jobs.__path__)
              if m.name != "cli" and hasattr(importlib.import_module(f"jobs.{m.name}"), "main"))
REQUIRED = {
    "bench_models": ["--output", "o"],
    "build_dataset": ["--config", "c.yaml"],
    "build_trigram": ["--corpus", "c.txt", "--tokenizer", "t", "--output", "o.npz"],
    "counterfactual": ["--generator", "g", "--reward", "r", "--prompts", "p.jsonl"],
    "evaluate": ["--pairs", "out"],
    "expert_iteration": ["--config", "c.yaml", "--rounds", "1", "--output", "o"],
    "fetch_models": ["--output", "o"],
    "gguf_convert": ["--gguf", "m.gguf", "--output", "o"],
    "make_ifbench_prompts": [],
    "make_ifeval_prompts": [],
    "make_tiny_models": ["--output", "o"],
    "train_reward_transformer": ["--pairs", "p", "--generator", "g", "--output", "o"],
}
"""Each job's required flags (any values: the tests stop before they are used)."""
RENAMED = {"--model": "--generator", "--policy": "--generator", "--reward-model": "--reward", "--judge": "--reward",
           "--n": "--num-samples", "--samples": "--num-samples", "--output-dir": "--output", "--out": "--output",
           "--input": "--prompts", "--max-prompts": "--num-prompts", "--max-tokens": "--max-new-tokens",
           "--torch-dtype": "--dtype", "--override": "--set", "--quiet": "--no-progress",
           "--committed-head-only": "--committed-only"}
"""Names a job must not use, with the one name every job uses for that meaning (jobs.cli)."""


class Parsed(Exception):
    """Raised in place of parsing: carries the parser a job's main built."""

    def __init__(self, parser):
        self.parser = parser


def job_parser(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser job ``name``'s main builds (its parse_args stopped before it parses)."""

    def stop(self, args=None, namespace=None):
        raise Parsed(self)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", stop)
        with pytest.raises(Parsed) as caught:
            importlib.import_module(f"jobs.{name}").main([])
    return caught.value.parser


def flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


def run_help(name: str, argv: list[str], capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "2000")  # no wrapping: a default is never split over two lines
    with pytest.raises(SystemExit) as exited:
        importlib.import_module(f"jobs.{name}").main(argv)
    assert exited.value.code == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_every_job_is_listed():
    assert JOBS == sorted(REQUIRED)
    assert set(SCRIPTS) <= {f"jobs.{name}" for name in JOBS}


@pytest.mark.parametrize("name", JOBS)
def test_help_names_the_program_and_every_default(name, capsys, monkeypatch):
    out = run_help(name, ["--help"], capsys, monkeypatch)
    prog = SCRIPTS.get(f"jobs.{name}", f"python -m jobs.{name}")
    assert out.startswith(f"usage: {prog} ")
    parser = job_parser(name, monkeypatch)
    actions = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert {"--log-level", "--no-progress"} <= {o for a in actions for o in a.option_strings}
    for action in actions:
        flag = action.option_strings[0]
        assert action.help, f"{name}: {flag} has no help text"
        if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction):
            # A switch (--dpo, --no-keep-lowest): its stored value is no default worth showing.
            assert "%(default)" not in parser._get_formatter()._get_help_string(action), f"{name}: {flag}"
        elif action.default not in (None, [], "", argparse.SUPPRESS):
            assert f"(default: {action.default})" in out, f"{name}: {flag}'s default {action.default!r} not shown"


@pytest.mark.parametrize("name", JOBS)
def test_no_job_has_another_name_for_a_flag(name, monkeypatch):
    taken = flags(job_parser(name, monkeypatch))
    for old, new in RENAMED.items():
        assert old not in taken, f"{name}: {old} is called {new} in every job"


def test_a_flag_takes_the_same_values_in_every_job(monkeypatch):
    seen: dict[str, tuple[str, list | None]] = {}
    for name in JOBS:
        for option, action in flags(job_parser(name, monkeypatch)).items():
            choices = list(action.choices) if action.choices is not None else None
            first = seen.setdefault(option, (name, choices))
            assert first[1] == choices, f"{option}: {first[0]} takes {first[1]}, {name} takes {choices}"


@pytest.mark.parametrize("name", JOBS)
def test_log_level_is_taken_and_set_first(name, monkeypatch):
    module = importlib.import_module(f"jobs.{name}")
    where = importlib.import_module("jobs.make_tiny_models" if name == "bench_models" else f"jobs.{name}")
    levels = []

    def record(level):
        levels.append(level)
        raise Parsed(None)  # stop before the job does anything

    monkeypatch.setattr(where, "setup_logging", record)
    with pytest.raises(Parsed):
        module.main([*REQUIRED[name], "--log-level", "debug"])
    assert levels == ["DEBUG"]
    with pytest.raises(SystemExit) as exited:
        module.main([*REQUIRED[name], "--log-level", "chatty"])
    assert exited.value.code == 2


def test_log_level_debug_reaches_the_loggers(tmp_path, capsys):
    from jobs.counterfactual import main

    try:
        assert main(["--generator", "g", "--reward", "r", "--prompts", str(tmp_path / "none.jsonl"),
                     "--log-level", "debug"]) == 2
        assert logging.getLogger("jobs").level == logging.DEBUG
        assert logging.getLogger("pipeline").level == logging.DEBUG
    finally:
        setup_logging("INFO")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "none.jsonl" in err[0]


@pytest.mark.parametrize("name", ["build_dataset", "expert_iteration"])
def test_help_config_documents_every_key(name, capsys, monkeypatch):
    out = run_help(name, ["--help-config"], capsys, monkeypatch)
    keys = [line.split(" (", 1)[0] for line in out.splitlines() if line and not line.startswith(" ")]
    assert keys == [d.key for d in key_docs()]
    assert "(undocumented)" not in out
    assert all(d.doc for d in key_docs())


@pytest.mark.parametrize("name", ["build_dataset", "expert_iteration", "evaluate"])
def test_help_lists_every_strategy(name, capsys, monkeypatch):
    out = run_help(name, ["--help"], capsys, monkeypatch)
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("  ") and line.split()[0] in STRATEGIES}
    assert listed == set(STRATEGIES)
    for record in STRATEGIES.values():
        assert record.summary in out and all(alias in out for alias in record.aliases)


def test_counterfactual_logs_a_line_per_prompt_without_bars(caplog):
    """Where there are no bars (stderr not a terminal, --no-progress), the collection loop says
    where it is at INFO; beside a bar, at DEBUG only."""
    from jobs.counterfactual import collect
    from pipeline.decoding.domain import PromptInput
    from pipeline.decoding.sampling import SamplingParams

    class Row:
        def __init__(self, row):
            self.row, self.text, self.token_ids, self.finished = row, "x", [1, 2], False

    class Fake:
        streaming = True

        def open(self, *args, columns=None):
            self.n = args[2]

        def extend(self, session, *args, until=None, finished=None):
            return [Row(r) for r in range(self.n)] if until is not None else [0.0] * len(args[0])

        def close(self, session):
            pass

    prompts = [PromptInput(f"p{i}", "t", "t", [1]) for i in range(2)]
    sampling = SamplingParams(max_new_tokens=4)
    with caplog.at_level(logging.DEBUG, logger="jobs"):
        collect(Fake(), [Fake()], prompts, 3, [2], sampling, seed=0, progress=False)
        collect(Fake(), [Fake()], prompts, 3, [2], sampling, seed=0, progress=True)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "jobs.counterfactual"]
    assert lines == [(logging.INFO, "counterfactual: prompt 1/2, 3 completions"),
                     (logging.INFO, "counterfactual: prompt 2/2, 3 completions"),
                     (logging.DEBUG, "counterfactual: prompt 1/2, 3 completions"),
                     (logging.DEBUG, "counterfactual: prompt 2/2, 3 completions")]


# -- extras used in one corner: a one-line error naming the extra where it is missing ---------------

@pytest.fixture
def without(monkeypatch):
    """Make ``importlib.util.find_spec`` and ``import`` report the named packages missing."""
    import builtins
    import importlib.util

    def hide(*names):
        real_find, real_import = importlib.util.find_spec, builtins.__import__
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, **k: None if name.split(".")[0] in names else real_find(name, *a, **k))

        def fake_import(name, *args, **kwargs):
            if name.split(".")[0] in names:
                raise ImportError(f"No module named {name!r}")
            return real_import(name, *args, **kwargs)

        monkeypatch.setattr(builtins, "__import__", fake_import)

    return hide


def test_gguf_conversion_without_the_gguf_extra_is_one_line_exit_2(without, tmp_path, capsys):
    from jobs import gguf_convert

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    without("gguf")
    assert gguf_convert.main(["--gguf", str(tmp_path / "m.gguf"), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: reading a GGUF file needs the gguf package: pip install 'bon-pipeline[gguf]'"]


def test_counterfactual_without_the_plots_extra_stops_before_sampling(without, tmp_path, capsys):
    from jobs import counterfactual

    without("matplotlib")
    rc = counterfactual.main(["--generator", "no-such-model", "--reward", "no-such-model", "--prompts",
                              str(tmp_path / "none.jsonl")])
    assert rc == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: the trade-off plots need matplotlib: pip install 'bon-pipeline[plots]'"]


def test_benchmark_plots_without_the_plots_extra_are_one_line_exit_2(without, capsys):
    from benchmarks import pyplot

    without("matplotlib")
    with pytest.raises(SystemExit) as exc:
        pyplot()
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == "error: the plots need matplotlib: pip install 'bon-pipeline[plots]'"


def test_help_config_into_a_pipe_that_closes_early_ends_quietly():
    """`bon-build --help-config | head`: the reader closes the pipe; before, a BrokenPipeError traceback."""
    import subprocess
    import sys

    done = subprocess.run(["bash", "-c", f"set -o pipefail; {sys.executable} -m jobs.build_dataset --help-config | head -n 2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("models.generator (string") and done.stderr == ""


def test_build_takes_the_model_flags_of_the_other_jobs_and_needs_no_config(monkeypatch):
    """README's shared flags: --generator --reward --device --dtype --prompt-column set their config keys
    in bon-build too (before: "unrecognized arguments: --generator", and --config was required)."""
    import pipeline.build
    from jobs import build_dataset

    planned = []

    def plan(config, overwrite=False):
        planned.append(config)
        raise Parsed(None)  # stop before the input is read

    monkeypatch.setattr(pipeline.build, "plan_build", plan)
    shared = ["--prompts", "p.jsonl", "--output", "o", "--device", "cuda:1", "--dtype", "bfloat16",
              "--prompt-column", "question"]
    for argv in (["--generator", "gen", "--reward", "true", *shared],  # "true": a name, not YAML's boolean
                 ["--generator", "gen", "--reward", "r1", "r2", "--set", "models.reward_weights=[1, 0.5]", *shared]):
        with pytest.raises(Parsed):
            build_dataset.main(argv)
    one, two = planned
    assert (one.models.generator, one.models.reward, one.models.device, one.models.dtype, one.data.prompt_column,
            one.data.prompts, one.data.output) == ("gen", "true", "cuda:1", "bfloat16", "question", "p.jsonl", "o")
    assert two.models.reward == ["r1", "r2"]
    with pytest.raises(SystemExit) as refused:  # --dtype takes the values it takes in every job
        build_dataset.main(["--dtype", "float64"])
    assert refused.value.code == 2
