"""Streaming input (pipeline.build, pipeline.data.prompts): the driver reads, validates and plans
shard by shard, and runs the prompts of a bounded window of shards at a time.

- planning holds one shard, not the input: its traced Python memory does not grow from 5,000 to
  20,000 rows (JSONL and Parquet; today's in-memory plan grew by megabytes);
- a 20,000-row build over simulated actors (benchmarks.cluster_sim's, through the real build,
  coordinator and commit code) hands the coordinator bounded windows, and its pairs and rejects
  (reasons, source rows) are exactly what the in-memory validation of the whole input gives:
  duplicates of rows many shards back included; a build that dies midway resumes from its
  committed shards to the same output, duplicates of committed rows still rejected;
- the same with the tiny models, windows of two prompts, and a prompt too long to keep.
"""

from __future__ import annotations

import json
import tracemalloc
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline.build
from benchmarks.input_memory import sim_workers
from pipeline.build import plan_build, run_build
from pipeline.errors import ShardFailed
from pipeline.config import load_config
from pipeline.coordinator import Coordinator
from pipeline.errors import WorkerFailure
from pipeline.data.prompts import validate
from pipeline.data.readers import PromptSource, read_raw_rows
from pipeline.errors import InputError
from pipeline.engines.hf import load_tokenizer
from tests.conftest import write_jsonl

SHARD = 64


def prompt_value(i: int):
    """Row i of the test input: mostly distinct prompts, with bad rows and duplicates scattered;
    a duplicate repeats row 2 * (i % 40), dozens to hundreds of shards back."""
    if i % 997 == 500:
        return prompt_value(2 * (i % 40))
    if i % 101 == 3:
        return "  \t"
    if i % 103 == 7:
        return None
    return f"Prompt {i}: say something about item {i * 31 % 1009}."


def write_input(path: Path, rows: int) -> Path:
    if path.suffix == ".jsonl":
        return write_jsonl(path, [{} if prompt_value(i) is None else {"prompt": prompt_value(i)} for i in range(rows)])
    pq.write_table(pa.table({"prompt": [prompt_value(i) for i in range(rows)]}), path, row_group_size=3000)
    return path


def sim_config(generator: Path, prompts: Path, out: Path, *overrides: str):
    # The simulated workers never load the reward model, but planning checks that it is one.
    settings = [f"models.generator={generator}", f"models.reward={generator.parent / 'reward'}", "models.draft=",
                f"data.prompts={prompts}", f"data.output={out}", f"data.shard_size={SHARD}",
                "sampling.num_samples=2", "sampling.max_new_tokens=2", "runtime.local=true",
                "runtime.prompts_per_batch=16", "runtime.batches_in_flight=2", *overrides]
    return load_config("configs/demo.yaml", settings, strategy="best_of_n")


def expected_rejects(prompts: Path) -> dict[int, str]:
    """source row -> reason, from validating the whole input in memory."""
    _, rejects = validate(read_raw_rows(str(prompts), "prompt"), "prompt")
    return {r.source_row: r.reason for r in rejects}


def read_output(out: Path) -> tuple[dict[int, str], dict[int, str]]:
    """(source row -> prompt_id of each pair, source row -> reason of each reject), checking that no
    row appears twice."""
    pairs, rejects = {}, {}
    for part in sorted(out.glob("train-*.parquet")):
        for row in pq.read_table(part, columns=["source_row", "prompt_id"]).to_pylist():
            assert row["source_row"] not in pairs
            pairs[row["source_row"]] = row["prompt_id"]
    for part in sorted((out / "_rejects").glob("part-*.parquet")):
        for row in pq.read_table(part, columns=["source_row", "reason"]).to_pylist():
            assert row["source_row"] not in rejects and row["source_row"] not in pairs
            rejects[row["source_row"]] = row["reason"]
    return pairs, rejects


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_planning_memory_does_not_grow_with_the_row_count(suffix, tiny_models, tmp_path):
    load_tokenizer(str(tiny_models["generator"]))  # the first load's caches are not the input's
    peaks = {}
    for rows in (5000, 20000):
        prompts = write_input(tmp_path / f"in-{rows}{suffix}", rows)
        tracemalloc.start()
        plan = plan_build(sim_config(tiny_models["generator"], prompts, tmp_path / f"out-{rows}"))
        peaks[rows] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        plan.first_rows.close()
        assert (plan.prompts_in, plan.num_shards) == (rows, -(-rows // SHARD))
        assert plan.pending == list(range(plan.num_shards))
        assert plan.rows_to_run == rows - len(expected_rejects(prompts))
    # 15,000 more rows: an in-memory plan holds their values, rows and tokenized prompts (about
    # 1.5 KiB a row here, 20+ MiB); the streaming plan, one shard and a fingerprint per shard.
    assert peaks[20000] - peaks[5000] < 512 * 1024, peaks


def test_20000_rows_run_in_bounded_windows_and_resume_after_a_crash(tiny_models, tmp_path, monkeypatch):
    prompts = write_input(tmp_path / "in.jsonl", 20000)
    out = tmp_path / "out"
    window = pipeline.build.WINDOW_ROUNDS * 1 * 2 * 16  # generators x batches_in_flight x prompts_per_batch
    handed = []
    run = Coordinator.run
    monkeypatch.setattr(Coordinator, "run", lambda self, batch: (handed.append(len(batch)), run(self, batch))[1])

    # First run: the generator dies for good after 300 batches (in the third window): committed shards stay.
    workers = sim_workers(1, 1)
    opens, open_batch = [0], workers.generators[0].open

    def dying_open(*args, **kwargs):
        opens[0] += 1
        if opens[0] > 300:
            raise WorkerFailure("generator lost")
        return open_batch(*args, **kwargs)

    monkeypatch.setattr(workers.generators[0], "open", dying_open, raising=False)
    with pytest.raises(ShardFailed, match="failed after 1 attempts"):
        run_build(plan_build(sim_config(tiny_models["generator"], prompts, out, "runtime.max_attempts=1")), workers,
                  progress=False)
    committed = sorted(int(p.stem.split("-")[1]) for p in (out / "_markers").glob("part-*.json"))
    assert 60 < len(committed) < 313 and not (out / "_SUCCESS").exists()
    assert max(handed) <= window + SHARD and len(handed) == 3
    before = {k: (out / f"train-{k:05d}.parquet").stat().st_mtime_ns for k in committed}

    # The rerun skips them and builds the rest, a window at a time.
    handed.clear()
    manifest = run_build(plan_build(sim_config(tiny_models["generator"], prompts, out)), sim_workers(1, 1),
                         progress=False)
    assert manifest["shards_skipped"] == committed and len(committed) + len(manifest["shards_written"]) == 313
    assert {k: (out / f"train-{k:05d}.parquet").stat().st_mtime_ns for k in committed} == before
    assert max(handed) <= window + SHARD and len(handed) >= (20000 - 64 * len(committed)) // (window + SHARD)

    pairs, rejects = read_output(out)
    want = expected_rejects(prompts)
    assert rejects == want and sorted(pairs) == sorted(set(range(20000)) - set(want))
    assert len(set(pairs.values())) == len(pairs)
    duplicates = {row: reason for row, reason in want.items() if reason.startswith("duplicate")}
    assert len(duplicates) == 20 and duplicates[19443] == "duplicate prompt (same as row 6)"
    assert all(row // SHARD - int(reason.split()[-1][:-1]) // SHARD >= 7 for row, reason in duplicates.items())
    # ... and the duplicates in shards redone by the rerun point back into shards it skipped.
    assert any(row // SHARD not in committed and int(reason.split()[-1][:-1]) // SHARD in committed
               for row, reason in duplicates.items())
    assert (manifest["prompts_in"], manifest["pairs"], manifest["shards"]) == (20000, len(pairs), 313)
    assert manifest["reject_reasons"] == dict(Counter(reason.split(" (")[0] for reason in want.values()))
    report = json.loads((out / "_report.json").read_text())
    assert report["prompts"] == report["pairs"] == manifest["pairs_this_run"] == sum(
        1 for row in pairs if row // SHARD not in committed)


def test_tiny_models_build_in_windows_of_two_prompts(tiny_models, tmp_path, monkeypatch):
    """Real models, every window transition and read-ahead exercised: windows of two prompts (the
    round of one generator, one batch of one prompt in flight, x 2), shards of three rows."""
    monkeypatch.setattr(pipeline.build, "WINDOW_ROUNDS", 2)
    values = [f"Describe gadget number {i} in one line." for i in range(14)]
    values[3], values[7], values[12] = "  ", values[1], values[0]  # a blank, duplicates 2 and 4 shards back
    values[9] = "a very long request " * 200  # over max_prompt_tokens: rejected at formatting
    prompts = write_jsonl(tmp_path / "in.jsonl", [{"prompt": v} for v in values])
    out = tmp_path / "out"
    overrides = [f"models.generator={tiny_models['generator']}", f"models.reward={tiny_models['reward']}",
                 f"data.prompts={prompts}", f"data.output={out}", "data.shard_size=3", "data.overlength=reject",
                 "sampling.num_samples=2", "sampling.max_new_tokens=6", "runtime.local=true",
                 "runtime.prompts_per_batch=1", "runtime.batches_in_flight=1"]
    from actors.factory import start_workers

    config = load_config("configs/demo.yaml", overrides, strategy="best_of_n")
    workers = start_workers(config)
    manifest = run_build(plan_build(config), workers, progress=False)
    pairs, rejects = read_output(out)
    assert {row: reason.split(" (")[0] for row, reason in rejects.items()} == {
        3: "blank prompt", 7: "duplicate prompt", 9: "prompt too long", 12: "duplicate prompt"}
    assert rejects[7] == "duplicate prompt (same as row 1)" and rejects[12] == "duplicate prompt (same as row 0)"
    assert sorted(pairs) == [0, 1, 2, 4, 5, 6, 8, 10, 11, 13]
    assert manifest["prompts_in"] == 14 and manifest["shards"] == 5
    assert json.loads((out / "_report.json").read_text())["prompts"] == 10

    # Resume with the shards holding the duplicates' originals committed and theirs redone.
    for k in (2, 4):
        (out / "_markers" / f"part-{k:05d}.json").unlink()
    manifest = run_build(plan_build(config), workers, progress=False)
    assert manifest["shards_written"] == [2, 4] and manifest["shards_skipped"] == [0, 1, 3]
    assert read_output(out) == (pairs, rejects)


def test_input_changed_between_planning_and_running_is_an_input_error(tiny_models, tmp_path):
    prompts = write_input(tmp_path / "in.jsonl", 300)
    plan = plan_build(sim_config(tiny_models["generator"], prompts, tmp_path / "out"))
    write_jsonl(prompts, [{"prompt": f"another prompt {i}"} for i in range(300)])
    with pytest.raises(InputError, match="changed while the build ran .*shard 0"):
        run_build(plan, sim_workers(1, 1), progress=False)


def test_s3_parquet_and_saved_dataset_are_read_shard_by_shard():
    moto_server = pytest.importorskip("moto.server")
    import boto3
    import datasets
    import s3fs

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        options = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing",
                   "client_kwargs": {"region_name": "us-east-1"}}
        boto3.client("s3", endpoint_url=options["endpoint_url"], aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket="bucket")
        values = [prompt_value(i) for i in range(5000)]
        with s3fs.S3FileSystem(**options).open("bucket/in/prompts.parquet", "wb") as f:
            pq.write_table(pa.table({"prompt": values}), f, row_group_size=700)
        datasets.Dataset.from_dict({"prompt": values}).save_to_disk("s3://bucket/saved", storage_options=options,
                                                                    num_shards=3)
        for uri in ("s3://bucket/in/prompts.parquet", "s3://bucket/saved"):
            shards = list(PromptSource(uri, "prompt", options).shards(SHARD))
            assert [k for k, _ in shards] == list(range(79)), uri
            assert all(len(chunk) == SHARD for _, chunk in shards[:-1]) and len(shards[-1][1]) == 5000 - 78 * SHARD
            assert [v for _, chunk in shards for v in chunk] == values, uri
    finally:
        server.stop()
