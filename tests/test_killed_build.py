"""A killed build's leftovers are not read (issue 29): every reader of a build (DPO and reward
training's load_pairs, expert iteration, jobs.evaluate, ``datasets.load_dataset(OUT)`` through the
card) reads exactly the committed shards, through the output store.

The build is really killed: ``python -m jobs.build_dataset`` in a subprocess whose reward function
never returns for the third shard's prompts, SIGKILLed once the first two shards' commit markers
are on disk. What a kill at other moments leaves is then put beside them by hand, since no timing
of a kill makes each reliably: a pair file with its side file but no marker (killed between the
pair file and the marker), a pair file still under its temp name, and a marker under its temp name
(killed before the rename).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.evaluate import main as evaluate_main
from jobs.evaluate import read_pairs
from jobs.expert_iteration import finished
from pipeline.errors import IncompleteBuild
from pipeline.training.dpo import load_pairs
from tests.conftest import GOOD_PROMPTS, write_jsonl

STALL = "STALL"
REWARD = f'''
import time


def reward(prompts, completions, **_):
    """A checksum of the text as the reward (ties are rare: every prompt makes a pair); a batch with
    a {STALL} prompt never returns (the build is killed there)."""
    if any("{STALL}" in str(p) for p in prompts):
        time.sleep(3600)
    return [sum(map(ord, str(c))) % 997 / 997 for c in completions]
'''
LEFTOVER = "LEFTOVER"


def kill_mid_build(tiny_models, tmp: Path) -> Path:
    """Run a three-shard build (two prompts a shard, one batch in flight, so shards commit in order)
    and SIGKILL it once shards 0 and 1 have their markers; shard 2 stalls in its reward."""
    (tmp / "stall_reward.py").write_text(REWARD)
    prompts = write_jsonl(tmp / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:4]]
                          + [{"prompt": f"{STALL} {p}"} for p in GOOD_PROMPTS[4:6]])
    out = tmp / "out"
    command = [sys.executable, "-m", "jobs.build_dataset", "--config", "configs/demo.yaml", "--strategy", "best_of_n",
               "--prompts", str(prompts), "--output", str(out), "--max-new-tokens", "6", "--num-samples", "2",
               "--set", f"models.generator={tiny_models['generator']}", "--set", "models.reward=stall_reward:reward",
               "--set", "runtime.local=true", "--set", "data.shard_size=2", "--set", "runtime.prompts_per_batch=2",
               "--set", "runtime.batches_in_flight=1", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), os.getcwd(), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    build = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "_markers" / "part-00001.json").exists():
            assert build.poll() is None, f"the build ended before it was killed: {build.stderr.read().decode()}"
            assert time.monotonic() < deadline, "shard 1 was not committed within 300 s"
            time.sleep(0.2)
    finally:
        if build.poll() is None:
            os.killpg(build.pid, signal.SIGKILL)
        build.wait()
        build.stderr.close()
    assert build.returncode == -signal.SIGKILL
    return out


def leave_leftovers(out: Path) -> None:
    """Beside the real kill's output: what other moments of a kill leave, each holding rows whose
    prompt starts with LEFTOVER (so a reader that reads any of them is caught)."""
    table = pq.read_table(out / "train-00000.parquet")
    prompts = [f"{LEFTOVER} {p}" for p in table.column("prompt").to_pylist()]
    stray = table.set_column(table.schema.get_field_index("prompt"), "prompt", pa.array(prompts))
    pq.write_table(stray, out / ".pending-train-00002.parquet")  # killed between the pair file and its marker
    (out / "_rejects" / "part-00002.parquet").write_bytes((out / "_rejects" / "part-00000.parquet").read_bytes())
    pq.write_table(stray, out / ".tmp-0123abcd-train-00003.parquet")  # killed before the rename
    # A whole marker for shard 2 under its temp name: a reader that took it would read train-00002.
    marker = json.loads((out / "_markers" / "part-00000.json").read_text())
    payload = (out / ".pending-train-00002.parquet").read_bytes()
    marker.update(shard=2, part="train-00002.parquet", rows=stray.num_rows, bytes=len(payload),
                  sha256=hashlib.sha256(payload).hexdigest())
    (out / "_markers" / ".tmp-4567cdef-part-00002.json").write_text(json.dumps(marker))


def committed_rows(out: Path) -> list[tuple]:
    """(prompt, chosen, rejected) of every row the commit markers name, read from the files as the
    test's own ground truth."""
    rows = []
    for marker in sorted((out / "_markers").glob("part-*.json")):
        rows += pq.read_table(out / json.loads(marker.read_text())["part"]).to_pylist()
    return [(r["prompt"], r["chosen"], r["rejected"]) for r in rows]


@pytest.fixture(scope="module")
def killed(tiny_models, tmp_path_factory) -> Path:
    out = kill_mid_build(tiny_models, tmp_path_factory.mktemp("killed"))
    assert sorted(p.name for p in (out / "_markers").iterdir()) == ["part-00000.json", "part-00001.json"]
    assert not (out / "_SUCCESS").exists() and (out / "_lease.json").exists()
    leave_leftovers(out)
    return out


def test_every_reader_refuses_a_killed_build_without_allow_partial(killed, capsys):
    for uri in (str(killed), str(killed / "train-*.parquet")):
        with pytest.raises(IncompleteBuild, match="no _SUCCESS"):
            load_pairs(uri)
    with pytest.raises(IncompleteBuild, match="no _SUCCESS"):
        read_pairs(str(killed), allow_partial=False)
    capsys.readouterr()
    assert evaluate_main(["--pairs", str(killed)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {killed}: not a finished build (no _SUCCESS)") and err.count("\n") == 1
    assert not finished(killed)  # expert iteration builds the round again (it resumes shard by shard)


def test_every_reader_reads_exactly_the_committed_rows(killed):
    committed = committed_rows(killed)
    assert len(committed) == 4 and not any(p.startswith(LEFTOVER) for p, _, _ in committed)
    lines = []
    for uri in (str(killed), str(killed / "train-*.parquet")):
        # token_ids: expert iteration's and reward training's read (jobs.expert_iteration.train).
        pairs = load_pairs(uri, token_ids=True, allow_partial=True, say=lines.append)
        assert Counter(zip(pairs["prompt"], pairs["chosen"], pairs["rejected"])) == Counter(committed)
    assert len(lines) == 2 and all("read 2 of its 2 committed shards" in line for line in lines)
    # The directory's reader counts the pair file left under its pending name; the glob's does not match it.
    assert "ignored 1 part file(s) with no commit marker" in lines[0] and "ignored" not in lines[1]
    rows = read_pairs(str(killed), allow_partial=True)
    assert Counter((r["prompt"], r["chosen"], r["rejected"]) for r in rows) == Counter(committed)


def test_the_killed_builds_pairs_are_exactly_the_committed_ones_by_card_and_by_file_name(killed, tmp_path,
                                                                                         monkeypatch):
    """A pair file gets its name only at its commit, and the card names the pairs by that glob:
    after the kill, load_dataset(OUT) and load_dataset("parquet", data_dir=OUT) both read exactly
    the committed rows, never a leftover."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    for loaded in (datasets.load_dataset(str(killed), split="train"),
                   datasets.load_dataset("parquet", data_dir=str(killed), split="train")):
        assert Counter(zip(loaded["prompt"], loaded["chosen"], loaded["rejected"])) == Counter(committed_rows(killed))
