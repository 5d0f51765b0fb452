"""The commit protocol of pipeline.data.store: markers, resume decisions, conflicts, _SUCCESS checks."""

import json

import pyarrow.parquet as pq
import pytest

from pipeline.data.store import OutputStore, fingerprint, marker_name, part_name, side_name
from pipeline.errors import OutputConflict

REJECT = {"source_row": 1, "prompt_id": None, "reason": "blank prompt", "value": "' '", "stage": "input",
          "generated_tokens": 0, "bon_equivalent_tokens": 0}
PAIR = {"prompt_id": "x", "prompt": "p", "chosen": "a", "rejected": "b", "chosen_score": 1.0, "rejected_score": 0.0,
        "strategy": "sbon", "num_candidates": 2, "generated_tokens": 3, "source_row": 0}


def test_commit_writes_data_then_marker_and_nothing_else(tmp_path):
    store = OutputStore(str(tmp_path))
    marker = store.commit_shard(0, [PAIR], [REJECT], fingerprint(["p", " "]), "cfg", {"pairs": 1})
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == [
        "_markers/part-00000.json", "_quarantine/part-00000.parquet", "_rejects/part-00000.parquet",
        "train-00000.parquet"]
    on_disk = json.loads((tmp_path / "_markers" / marker_name(0)).read_text())
    assert on_disk == json.loads(json.dumps(marker))
    assert on_disk["rows"] == 1 and on_disk["rejects"]["rows"] == 1 and on_disk["quarantine"]["rows"] == 0
    assert on_disk["bytes"] == (tmp_path / part_name(0)).stat().st_size and len(on_disk["sha256"]) == 64
    assert store.committed({0: (fingerprint(["p", " "]), "cfg")}) == {0}
    assert pq.ParquetFile(tmp_path / "_quarantine" / side_name(0)).metadata.num_row_groups == 0


def test_data_without_marker_is_redone_and_temp_files_are_ignored(tmp_path):
    store = OutputStore(str(tmp_path))
    store.commit_shard(0, [PAIR], [], "fp0", "cfg")
    store.commit_shard(1, [PAIR], [], "fp1", "cfg")
    (tmp_path / "_markers" / marker_name(1)).unlink()  # killed between the part file and its marker
    (tmp_path / ".tmp-dead-part-00002.parquet").write_bytes(b"PAR1 half")  # killed mid-write
    (tmp_path / "_markers" / ".tmp-dead-part-00002.json").write_text("{")
    expected = {k: (f"fp{k}", "cfg") for k in range(3)}
    assert store.committed(expected) == {0}
    store.acquire_lease("cfg")  # prepare() removes temp files only as the output's one writer
    store.prepare()
    store.release_lease()
    assert not list(tmp_path.rglob(".tmp-*"))
    # A pair file of ours that no marker claims goes: load_dataset("parquet", data_dir=OUT) would read it.
    assert not (tmp_path / part_name(1)).exists() and (tmp_path / part_name(0)).exists()
    # A part file that is not the one its marker describes (truncated by hand) is not committed either.
    (tmp_path / part_name(0)).write_bytes((tmp_path / part_name(0)).read_bytes()[:-10])
    assert store.committed(expected) == set()


def test_other_config_or_input_is_a_conflict_unless_overwritten(tmp_path):
    store = OutputStore(str(tmp_path))
    store.commit_shard(0, [PAIR], [REJECT], "fp0", "cfg-a")
    with pytest.raises(OutputConflict, match="different config.*--overwrite"):
        store.committed({0: ("fp0", "cfg-b")})
    with pytest.raises(OutputConflict, match="shard 0 was built from different input rows"):
        store.committed({0: ("fp-changed", "cfg-a")})
    with pytest.raises(OutputConflict, match="holds shard 0, but this input has 0 shards"):
        store.committed({})
    (tmp_path / "notes.txt").write_text("not ours")
    store.write_success({})
    store.acquire_lease("cfg-b")
    store.prepare(overwrite=True)
    store.release_lease()
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["notes.txt"]
    assert store.committed({0: ("fp0", "cfg-b")}) == set()


def test_verify_checks_every_marker_against_its_files(tmp_path):
    store = OutputStore(str(tmp_path))
    store.commit_shard(0, [PAIR], [], "fp0", "cfg")
    store.commit_shard(1, [], [REJECT], "fp1", "cfg")
    assert [k for k, _ in store.verify(2)] == [0, 1]
    assert [k for k, _ in store.verify(1)] == [0]  # markers past num_shards are not this build's
    with pytest.raises(RuntimeError, match="shard 2: no commit marker"):
        list(store.verify(3))
    (tmp_path / "_rejects" / side_name(1)).write_bytes(b"PAR1")
    with pytest.raises(RuntimeError, match=r"shard 1: _rejects/part-00001.parquet does not match"):
        list(store.verify(2))


def test_markers_are_read_and_verified_a_chunk_at_a_time_in_shard_order(tmp_path, monkeypatch):
    store = OutputStore(str(tmp_path))
    for k in (0, 1, 2, 3, 5):
        store.commit_shard(k, [PAIR], [], f"fp{k}", "cfg")
    monkeypatch.setattr(OutputStore, "MARKERS_PER_READ", 2)
    fetched = []
    cat = store.fs.cat
    monkeypatch.setattr(store.fs, "cat", lambda paths: (fetched.append(len(paths)), cat(paths))[1])
    assert [k for k, _ in store.iter_markers()] == [0, 1, 2, 3, 5] and fetched == [2, 2, 1]
    with pytest.raises(RuntimeError, match="shard 4: no commit marker"):
        list(store.verify(6))
    assert [k for k, _ in store.verify(4)] == [0, 1, 2, 3]


def test_fingerprint_is_order_and_type_sensitive():
    assert fingerprint(["a", "b"]) != fingerprint(["b", "a"])
    assert fingerprint([1]) != fingerprint(["1"])
    assert fingerprint([None, {"x": 1}]) == fingerprint([None, {"x": 1}])
