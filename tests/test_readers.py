"""Readers of a build read committed output only, through its output store (issues 27 and 29): a
killed build is refused with one line unless --allow-partial, which reads exactly the committed
shards and says how many; a part file with no commit marker is never read; a user's own pairs
files read as before. A real killed build: tests/test_killed_build.py."""

from __future__ import annotations

import shutil

import pyarrow.parquet as pq
import pytest

from jobs.build_dataset import main as build_main
from jobs.train_reward_transformer import main as train_main
from pipeline.errors import InputError
from pipeline.data.store import OutputStore
from pipeline.errors import IncompleteBuild
from pipeline.training.dpo import load_pairs
from tests.conftest import GOOD_PROMPTS, write_jsonl


@pytest.fixture(scope="module")
def finished(tiny_models, tmp_path_factory):
    """A finished three-shard build (two prompts a shard) on the tiny models."""
    tmp = tmp_path_factory.mktemp("readers")
    prompts = write_jsonl(tmp / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:6]])
    assert build_main(["--config", "configs/demo.yaml", "--strategy", "best_of_n", "--prompts", str(prompts),
                       "--output", str(tmp / "out"), "--set", f"models.generator={tiny_models['generator']}",
                       "--set", f"models.reward={tiny_models['reward']}", "--set", "runtime.local=true",
                       "--set", "data.shard_size=2", "--max-new-tokens", "6", "--num-samples", "2",
                       "--no-progress"]) == 0
    assert sorted(p.name for p in (tmp / "out").glob("train-*.parquet")) == [f"train-0000{k}.parquet" for k in range(3)]
    return tmp / "out"


def ids(path) -> set[str]:
    return set(pq.read_table(path, columns=["prompt_id"]).column("prompt_id").to_pylist())


def killed_copy(finished, dest):
    """What a SIGKILL after shard 2's part file but before its marker leaves: no _SUCCESS, shards
    0 and 1 committed, train-00002.parquet on disk with no marker."""
    out = shutil.copytree(finished, dest)
    (out / "_SUCCESS").unlink()
    (out / "_markers" / "part-00002.json").unlink()
    return out


def test_a_finished_build_reads_whole(finished):
    lines = []
    pairs = load_pairs(str(finished), say=lines.append)
    assert sorted(pairs["prompt"]) == sorted(pq.read_table(finished / "train-00000.parquet").column("prompt").to_pylist()
                                             + pq.read_table(finished / "train-00001.parquet").column("prompt").to_pylist()
                                             + pq.read_table(finished / "train-00002.parquet").column("prompt").to_pylist())
    assert len(pairs) == 6 and lines == []


def test_a_killed_build_is_refused_unless_allow_partial(finished, tmp_path):
    out = killed_copy(finished, tmp_path / "killed")
    # The old loader globbed part-* and trained on all three files, the markerless one included.
    for uri in (str(out), str(out / "train-*.parquet"), str(out / "train-00000.parquet")):
        with pytest.raises(IncompleteBuild, match="no _SUCCESS.*--allow-partial"):
            load_pairs(uri)
    lines = []
    pairs = load_pairs(str(out), token_ids=True, allow_partial=True, say=lines.append)
    from_markers = ids(out / "train-00000.parquet") | ids(out / "train-00001.parquet")
    assert len(pairs) == len(from_markers) == 4
    assert {r for r in pairs["prompt"]}.isdisjoint(pq.read_table(out / "train-00002.parquet").column("prompt").to_pylist())
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "unfinished (no _SUCCESS) build: read 2 of its 2 committed shards (4 pairs committed)" in lines[0]
    assert "ignored 1 part file(s) with no commit marker" in lines[0] and lines[0].endswith(f"4 pairs loaded from {out}")
    # A glob into the build reads through its store too: still never the markerless file.
    assert len(load_pairs(str(out / "train-0000[12].parquet"), allow_partial=True, say=lines.append)) == 2


def test_a_stray_or_damaged_part_file_in_a_finished_build(finished, tmp_path):
    out = shutil.copytree(finished, tmp_path / "stray")
    shutil.copy(out / "train-00000.parquet", out / "train-00007.parquet")  # no marker: never read
    lines = []
    assert len(load_pairs(str(out), say=lines.append)) == 6
    assert len(lines) == 1 and "ignored 1 part file(s) with no commit marker" in lines[0]
    # A committed part file changed after the build no longer matches its marker's sha256.
    shutil.copy(out / "train-00000.parquet", out / "train-00001.parquet")
    with pytest.raises(IncompleteBuild, match="shard\\(s\\) 1 no longer match their commit markers"):
        load_pairs(str(out))
    with pytest.raises(IncompleteBuild, match="shard\\(s\\) 1 no longer match"):  # the store's short form too
        OutputStore(str(out)).committed_parts()
    lines = []
    assert len(load_pairs(str(out), allow_partial=True, say=lines.append)) == 4
    assert "read 2 of its 3 committed shards" in lines[0] and "skipped shard(s) 1" in lines[0]


def test_a_corrupt_marker_is_one_input_error(finished, tmp_path):
    out = shutil.copytree(finished, tmp_path / "corrupt")
    (out / "_markers" / "part-00001.json").write_text("{not json")
    with pytest.raises(InputError, match="unreadable commit marker"):
        load_pairs(str(out))


def test_user_pairs_files_are_not_a_build(finished, tmp_path):
    """A directory of part files with none of the build's own files is the user's: read as it is."""
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in ("train-00000.parquet", "train-00002.parquet"):
        shutil.copy(finished / name, mine / name)
    lines = []
    assert len(load_pairs(str(mine), say=lines.append)) == 4 and lines == []
    assert not (mine / "_markers").exists()  # reading never creates the store's layout


def test_train_job_refuses_a_killed_build_with_one_line(finished, tmp_path, capsys, tiny_models):
    out = killed_copy(finished, tmp_path / "killed")
    for extra in ([], ["--dpo"]):
        rc = train_main(["--pairs", str(out), "--generator", str(tiny_models["generator"]), "--output",
                         str(tmp_path / "rt"), "--no-progress", *extra])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1
        assert err.startswith(f"error: {out}: not a finished build (no _SUCCESS)") and "--allow-partial" in err
    assert not (tmp_path / "rt").exists()
