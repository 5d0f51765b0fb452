"""s3:// input and output against a real S3 protocol server (moto on 127.0.0.1), in-process build."""

import json

import pytest

moto_server = pytest.importorskip("moto.server")

from jobs.build_dataset import main  # noqa: E402
from pipeline.training.dpo import load_pairs  # noqa: E402
from tests.conftest import GOOD_PROMPTS, MIXED_BAD_ROWS, MIXED_ROWS  # noqa: E402


def test_build_reads_and_writes_s3(s3, tiny_models):
    fs, options = s3
    with fs.open("bucket/in/prompts.jsonl", "w") as f:
        f.write("\n".join(json.dumps(r) for r in MIXED_ROWS) + "\n")
    storage = json.dumps(options)
    rc = main(["--config", "configs/demo.yaml", "--prompts", "s3://bucket/in/prompts.jsonl",
               "--output", "s3://bucket/out/run-1", "--set", f"data.storage_options={storage}",
               "--set", f"models.generator={tiny_models['generator']}", "--set", f"models.reward={tiny_models['reward']}",
               "--set", "runtime.local=true", "--num-samples", "4", "--max-new-tokens", "12",
               "--set", "strategy.decision_token=4", "--set", "data.shard_size=5", "--no-progress"])
    assert rc == 0
    fs.invalidate_cache()
    assert sorted(fs.ls("bucket/out/run-1", detail=False)) == [
        "bucket/out/run-1/README.md", "bucket/out/run-1/_SUCCESS", "bucket/out/run-1/_manifest.json",
        "bucket/out/run-1/_markers",
        "bucket/out/run-1/_quarantine", "bucket/out/run-1/_rejects", "bucket/out/run-1/_report.json",
        "bucket/out/run-1/train-00000.parquet", "bucket/out/run-1/train-00001.parquet",
        "bucket/out/run-1/train-00002.parquet"]
    assert len(fs.ls("bucket/out/run-1/_markers")) == 3
    manifest = json.loads(fs.cat("bucket/out/run-1/_manifest.json"))
    assert manifest["pairs"] == len(GOOD_PROMPTS) and manifest["prompts_rejected"] == len(MIXED_BAD_ROWS)
    pairs = load_pairs("s3://bucket/out/run-1", options)
    assert sorted(pairs.column_names) == ["chosen", "prompt", "rejected"] and pairs.num_rows == len(GOOD_PROMPTS)


PAIR = {"prompt_id": "x", "prompt": "p", "chosen": "a", "rejected": "b", "chosen_score": 1.0, "rejected_score": 0.0,
        "strategy": "sbon", "num_candidates": 2, "generated_tokens": 3, "source_row": 0}


def test_a_kill_between_the_copy_and_the_delete_of_a_commit_is_completed_on_resume(s3, monkeypatch):
    """On S3 a rename is a copy then a delete (fsspec's mv). A build killed between the two leaves the
    pair file and its ``.pending-`` copy; before, every resume kept the pending file (its marker
    claims it) and every reader warned about it. A resume completes it (deletes the pending copy of
    a pair file that matches its marker) and removes a pending file that no marker claims."""
    from pipeline.data.layout import pending_name
    from pipeline.data.store import OutputStore, part_name

    fs, options = s3
    uri, root = "s3://bucket/killed-rename", "bucket/killed-rename"
    expected = {k: (f"fp{k}", "cfg") for k in range(3)}
    store = OutputStore(uri, options)
    store.acquire_lease("cfg")
    store.prepare()
    store.commit_shard(0, [PAIR], [], "fp0", "cfg")
    real_rm = store.fs.rm

    def killed_at_the_delete(path, *args, **kwargs):
        if path.endswith(pending_name(1)):
            raise KeyboardInterrupt("killed between the copy and the delete")
        return real_rm(path, *args, **kwargs)

    monkeypatch.setattr(store.fs, "rm", killed_at_the_delete)
    with pytest.raises(KeyboardInterrupt):
        store.commit_shard(1, [PAIR, {**PAIR, "prompt_id": "y", "source_row": 1}], [], "fp1", "cfg")
    monkeypatch.undo()
    store.release_lease()
    # Shard 2: a pending pair file with no marker (killed before its marker was written).
    fs.pipe(f"{root}/{pending_name(2)}", fs.cat(f"{root}/{part_name(0)}"))
    fs.invalidate_cache()
    names = {p.rsplit("/", 1)[1] for p in fs.ls(root, detail=False)}
    assert {part_name(1), pending_name(1), pending_name(2)} <= names  # the kill left both of shard 1's files
    before = OutputStore.open_build(uri, options).read_committed(allow_partial=True)
    assert before.leftovers == [pending_name(1), pending_name(2)]  # what every reader warned about

    resumed = OutputStore(uri, options)
    resumed.acquire_lease("cfg")
    assert resumed.committed(expected) == {0, 1}
    resumed.prepare()
    resumed.release_lease()
    fs.invalidate_cache()
    names = {p.rsplit("/", 1)[1] for p in fs.ls(root, detail=False)}
    assert not [n for n in names if n.startswith(".pending-")], names
    assert {part_name(0), part_name(1)} <= names and part_name(2) not in names
    after = OutputStore.open_build(uri, options).read_committed(allow_partial=True)
    assert after.leftovers == [] and after.skipped == [] and after.pairs_committed == 3
    assert [p.rsplit("/", 1)[1] for p in after.parts] == [part_name(0), part_name(1)]
