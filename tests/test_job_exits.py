"""How a job ends, as a new user meets it: a user error of bon-evaluate exits 2 every time (never an
abort from a thread left running), Ctrl-C ends a build with exit 130 and one line saying what is
committed, an empty prompt file is a user error, a judge that tells no pair apart prints no NaN, and
training says how many pairs it left out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import GOOD_PROMPTS, write_jsonl

REPO = Path(__file__).resolve().parents[1]


def build_argv(tiny_models, prompts, output, *extra) -> list[str]:
    return ["--config", str(REPO / "configs" / "demo.yaml"), "--prompts", str(prompts), "--output", str(output),
            "--set", f"models.generator={tiny_models['generator']}", "--set", f"models.reward={tiny_models['reward']}",
            "--set", f"models.draft={tiny_models['draft']}", "--set", "runtime.local=true", "--no-progress", *extra]


@pytest.fixture(scope="module")
def plain_build(tiny_models, tmp_path_factory) -> Path:
    """A finished build of prompts without IFEval's columns (4 pairs, best_of_n, 4 tokens each)."""
    from jobs.build_dataset import main

    tmp = tmp_path_factory.mktemp("plain-build")
    prompts = write_jsonl(tmp / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:4]])
    assert main(build_argv(tiny_models, prompts, tmp / "out", "--strategy", "best_of_n", "--num-samples", "2",
                           "--max-new-tokens", "4")) == 0
    return tmp / "out"


# -- bon-evaluate's user error: exit 2 every time ------------------------------------------------------

def test_evaluate_reads_a_builds_parquet_with_no_python_file_in_arrows_threads(plain_build, monkeypatch):
    # Before: pq.read_table(fsspec file) read the footer and pre-buffered on Arrow's IO threads, which
    # could still hold that file's buffers after it returned; the last freed during interpreter exit
    # aborted the process (exit 134 in 6 of 20 runs). Here: every call on the file from a thread
    # that is not this one is recorded.
    from jobs import evaluate
    from pipeline.data import reader

    callers = set()
    open_build = reader.OutputReader.open_build

    class Watched:
        def __init__(self, f):
            self._f = f

        def __getattr__(self, name):
            callers.add(threading.current_thread().name)
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

    def watched_build(uri, storage_options=None):
        store = open_build(uri, storage_options)
        real_open = store.fs.open
        monkeypatch.setattr(store.fs, "open", lambda *a, **k: Watched(real_open(*a, **k)))
        return store

    monkeypatch.setattr(reader.OutputReader, "open_build", staticmethod(watched_build))
    rows = evaluate.read_pairs(str(plain_build), allow_partial=False)
    assert len(rows) == 4 and callers == {threading.current_thread().name}


@pytest.mark.slow  # processes that import torch and lm-eval: 72 s for six on two busy cores
def test_evaluate_without_instruction_columns_exits_2_every_time(plain_build):
    """The command as a user runs it, 4 at once (the abort came in 6 of 20 runs before; the test above is the
    deterministic one)."""
    runs = [subprocess.Popen([sys.executable, "-m", "jobs.evaluate", "--pairs", str(plain_build)], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    for run in runs:
        out, err = run.communicate(timeout=240)
        lines = err.strip().splitlines()
        assert (run.returncode, len(lines), out) == (2, 1, ""), err
        assert lines[0].startswith("error: ") and "no instruction_id_list/kwargs columns" in lines[0]


def test_pair_accuracy_when_the_judge_tells_no_pair_apart_is_no_nan():
    # Before: "pair accuracy nan%: chosen follows more in that share of the 0 pairs ...".
    from pipeline.evaluation import evaluate_pairs, format_pairs_report

    same = {"prompt": "Answer in lowercase.", "chosen": "all lowercase", "rejected": "also lowercase",
            "instruction_id_list": ["change_case:english_lowercase"], "kwargs": [{}]}
    report = evaluate_pairs([same, same])
    assert report["pairs_told_apart"] == 0
    text = format_pairs_report(report)
    line = next(line for line in text.splitlines() if line.startswith("pair accuracy"))
    assert "nan" not in text.lower() and "%" not in line, text


# -- Ctrl-C ------------------------------------------------------------------------------------------------

def test_ctrl_c_mid_build_exits_130_with_one_line_saying_what_is_committed(tiny_models, tmp_path):
    # Before: a KeyboardInterrupt traceback; exit 1, the code of a failed shard.
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{GOOD_PROMPTS[i % 6]} ({i})"} for i in range(48)])
    output = tmp_path / "out"
    argv = build_argv(tiny_models, prompts, output, "--set", "data.shard_size=4", "--num-samples", "4",
                      "--max-new-tokens", "16")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # SIGINT as a terminal's Ctrl-C sends it (the default action, whatever this process inherited).
    build = subprocess.Popen([sys.executable, "-m", "jobs.build_dataset", *argv], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    before = []
    for line in build.stderr:  # the first commit: mid-build, with something committed
        before.append(line)
        if " committed (" in line:
            build.send_signal(signal.SIGINT)
            break
    else:
        pytest.fail("the build ended before its first commit: " + "".join(before))
    out, err = build.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert (build.returncode, len(lines), out) == (130, 1, ""), err
    committed = len(list((output / "_markers").iterdir()))
    assert lines[0] == (f"error: interrupted (Ctrl-C): {committed} of 12 shards committed to {output}; rerun the "
                        "same command to resume from there")
    assert 1 <= committed < 12 and not (output / "_SUCCESS").exists()


def test_every_job_exits_130_on_ctrl_c_with_one_line(monkeypatch, capsys):
    """Ctrl-C wherever a job is (here: as it sets up its logging) is exit 130 and one line."""
    import importlib

    from tests.test_cli import JOBS, REQUIRED

    def ctrl_c(level):
        raise KeyboardInterrupt

    for name in JOBS:
        module = importlib.import_module(f"jobs.{name}")
        where = importlib.import_module("jobs.make_tiny_models" if name == "bench_models" else f"jobs.{name}")
        with monkeypatch.context() as patch:
            patch.setattr(where, "setup_logging", ctrl_c)
            try:
                code = module.main(list(REQUIRED[name]))
            except KeyboardInterrupt:  # (not raised on: it would stop the whole test run)
                pytest.fail(f"{name}: Ctrl-C is a traceback")
        assert code == 130, name
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: interrupted (Ctrl-C): ") and "rerun" in lines[0], \
            (name, lines)


# -- an empty prompt file -------------------------------------------------------------------------------

def test_an_empty_prompt_file_is_one_line_exit_2_before_any_worker(tiny_models, tmp_path, capsys, monkeypatch):
    # Before: "0 pairs", exit 0, and an output load_dataset does not open.
    import actors
    from jobs.build_dataset import main

    def refuse(config):
        raise AssertionError("workers started for an empty input")

    monkeypatch.setattr(actors, "start_workers", refuse)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(build_argv(tiny_models, empty, tmp_path / "out")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"error: {empty}: no rows (an empty input); nothing to build"]
    assert not (tmp_path / "out" / "_lease.json").exists()  # a later build is not locked out


# -- training says what it left out ------------------------------------------------------------------------

def test_training_counts_the_pairs_it_leaves_out_for_an_empty_response(tiny_models, tmp_path, capsys):
    # Before: a pair with an empty chosen was dropped without a word.
    from jobs.train_reward_transformer import main

    rows = [{"prompt": p, "chosen": f"{p} Yes, it is good.", "rejected": "No."} for p in GOOD_PROMPTS]
    rows[1]["chosen"] = ""
    rows[4]["rejected"] = ""
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "part-00000.parquet")
    assert main(["--pairs", str(tmp_path / "part-00000.parquet"), "--generator", str(tiny_models["generator"]),
                 "--output", str(tmp_path / "rt"), "--epochs", "1", "--hidden-size", "8", "--no-progress"]) == 0
    captured = capsys.readouterr()
    notes = [line for line in captured.err.splitlines() if "left out" in line]
    assert notes == [f"note: 2 of {len(rows)} pairs left out: an empty chosen or rejected response "
                     "(pairs_dropped_empty in training_metrics.json)"]
    assert "pairs_dropped_empty: 2" in captured.out.splitlines()
    metrics = json.loads((tmp_path / "rt" / "training_metrics.json").read_text())
    assert metrics["pairs_dropped_empty"] == 2 and metrics["train_pairs"] + metrics["eval_pairs"] == len(rows) - 2
