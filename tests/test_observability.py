"""Logs for batch jobs (issue 30, item 8): where stderr is not a terminal (ray job submit, CI) a build
logs one line per committed shard with its pairs, the rate and an ETA; --log-level filters them;
on a terminal the progress bars show instead."""

from __future__ import annotations

import re
import sys

import pytest

from jobs.build_dataset import main
from tests.conftest import GOOD_PROMPTS, write_jsonl

SHARD_LINE = re.compile(r"^shard (\d+) committed \((\d+)/(\d+) this run\): (\d+) pairs, (\d+) rejected \| "
                        r"(\d+)/(\d+) prompts, (\d+) pairs, [\d.]+ pairs/min, elapsed \d+:\d\d:\d\d, ETA (\d+:\d\d:\d\d)"
                        r"(?: \| KV (\d+)% of ([\d.]+) GiB, (\d+) preemptions(?:, (.+))?)?$")


def build(tiny_models, tmp_path, *extra) -> int:
    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:5]] + [{"prompt": ""}])
    return main(["--config", "configs/demo.yaml", "--prompts", str(prompts), "--output", str(tmp_path / "out"),
                 "--set", f"models.generator={tiny_models['generator']}", "--set",
                 f"models.reward={tiny_models['reward']}", "--num-samples", "2", "--max-new-tokens", "6",
                 "--set", "strategy.decision_token=3", "--set", "data.shard_size=2", "--set", "runtime.local=true",
                 *extra])


def shard_lines(err: str) -> list[re.Match]:
    return [m for m in map(SHARD_LINE.match, err.splitlines()) if m]


def test_a_line_per_committed_shard_with_pairs_rate_and_eta_when_stderr_is_not_a_terminal(tiny_models, tmp_path,
                                                                                         capsys):
    assert build(tiny_models, tmp_path) == 0
    lines = shard_lines(capsys.readouterr().err)
    assert sorted(int(m[1]) for m in lines) == [0, 1, 2]  # 6 rows, 2 per shard
    assert [int(m[2]) for m in lines] == [1, 2, 3] and {int(m[3]) for m in lines} == {3}
    last = lines[-1]
    assert int(last[6]) == int(last[7]) == 5  # every valid prompt done (the blank one is rejected at planning)
    assert int(last[8]) == sum(int(m[4]) for m in lines) == 5  # pairs so far = the shards' pairs
    assert last[9] == "0:00:00"
    # The HF generator's KV cache: its share of blocks in use (the finished rows' are back) and size.
    assert all(m[10] is not None for m in lines) and 0 <= int(last[10]) <= 100 and float(last[11]) > 0


def test_log_level_warning_silences_them_and_a_terminal_shows_bars_instead(tiny_models, tmp_path, capsys,
                                                                        monkeypatch):
    assert build(tiny_models, tmp_path / "a", "--log-level", "warning") == 0
    assert shard_lines(capsys.readouterr().err) == []
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert build(tiny_models, tmp_path / "b") == 0
    err = capsys.readouterr().err
    assert shard_lines(err) == [] and "prompts (sbon)" in err  # tqdm's bar


def test_a_resumed_build_counts_only_the_shards_it_runs(tiny_models, tmp_path, capsys):
    assert build(tiny_models, tmp_path, "--set", "runtime.faults=[]") == 0
    capsys.readouterr()
    (tmp_path / "out" / "_SUCCESS").unlink()
    marker = sorted((tmp_path / "out" / "_markers").glob("*.json"))[-1]
    marker.unlink()
    assert build(tiny_models, tmp_path) == 0
    lines = shard_lines(capsys.readouterr().err)
    assert [(int(m[2]), int(m[3])) for m in lines] == [(1, 1)]


@pytest.mark.parametrize("level", ["debug", "INFO", "Warning", "error"])
def test_log_level_takes_any_case(level):
    from jobs.build_dataset import parse_args

    assert parse_args(["--config", "x", "--log-level", level]).log_level == level.upper()
