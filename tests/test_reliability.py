"""Reliability on a local Ray cluster (num_cpus=2, one per module): actors that die or hang are
replaced and their batches resubmitted, retries are bounded, a killed driver leaves no half-written
shard, S3 settings reach the workers. Faults are real (os._exit, a sleeping actor, SIGKILL), injected
through runtime.faults (actors/faults.py). Run by `make test-reliability`."""

import json
import os
import signal
import subprocess
import sys
import time

import datasets
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")

from jobs.build_dataset import main  # noqa: E402
from pipeline.data.chat import prompt_id  # noqa: E402
from tests.conftest import GOOD_PROMPTS, moto_s3, write_jsonl  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.reliability]
EXPECTED_IDS = sorted(prompt_id(p) for p in GOOD_PROMPTS)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("in") / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS])


def args(tiny_models, prompts, out, *extra, faults=()):
    return ["--config", "configs/demo.yaml", "--prompts", str(prompts), "--output", str(out),
            "--set", f"models.generator={tiny_models['generator']}", "--set", f"models.reward={tiny_models['reward']}",
            "--num-samples", "4", "--max-new-tokens", "16", "--set", "strategy.decision_token=6",
            "--set", "data.shard_size=2", "--set", "runtime.prompts_per_batch=2", "--no-progress",
            "--set", f"runtime.faults={json.dumps(list(faults))}", *extra]


@pytest.fixture(scope="module")
def reference(tiny_models, prompts, tmp_path_factory):
    """The same build in-process with no faults: what every recovered build must equal."""
    out = tmp_path_factory.mktemp("reference") / "out"
    assert main(args(tiny_models, prompts, out, "--set", "runtime.local=true")) == 0
    return table(out)


def table(out):
    rows = datasets.load_dataset("parquet", data_files=str(out / "train-*.parquet"), split="train").to_list()
    return sorted(rows, key=lambda r: r["prompt_id"])


def assert_exactly_once(out, reference):
    rows = table(out)
    assert sorted(r["prompt_id"] for r in rows) == EXPECTED_IDS  # none lost, none duplicated
    assert [(r["prompt_id"], r["chosen_sample"], r["rejected_sample"], r["chosen"]) for r in rows] == [
        (r["prompt_id"], r["chosen_sample"], r["rejected_sample"], r["chosen"]) for r in reference]
    assert (out / "_SUCCESS").exists()


def test_actor_that_exits_mid_shard_is_replaced_and_its_batch_resubmitted(cluster, tiny_models, prompts, reference,
                                                                          tmp_path, capsys):
    fault = {"actor": "generator", "method": "extend", "call": 2, "action": "exit", "times": 1,
             "state_dir": str(tmp_path / "faults")}
    # Placement group too: the replacement must fit back into the dead actor's bundle.
    rc = main(args(tiny_models, prompts, tmp_path / "out", "--set", "runtime.placement_strategy=PACK", faults=[fault]))
    assert rc == 0
    assert os.listdir(tmp_path / "faults") == ["fault-0-0"]  # the fault did fire, once
    report = json.loads((tmp_path / "out" / "_report.json").read_text())
    assert report["actor_restarts"] == 1 and report["batch_retries"] >= 1
    assert "generator 0 actor died during" in capsys.readouterr().err
    assert_exactly_once(tmp_path / "out", reference)


def test_hung_actor_is_killed_after_the_timeout_and_replaced(cluster, tiny_models, prompts, reference, tmp_path):
    fault = {"actor": "reward", "method": "extend", "call": 2, "action": "hang", "times": 1,
             "state_dir": str(tmp_path / "faults")}
    started = time.monotonic()
    rc = main(args(tiny_models, prompts, tmp_path / "out", "--set", "runtime.call_timeout_s=10", faults=[fault]))
    assert rc == 0 and time.monotonic() - started < 240
    report = json.loads((tmp_path / "out" / "_report.json").read_text())
    assert report["actor_restarts"] == 1
    assert_exactly_once(tmp_path / "out", reference)


def test_retries_are_bounded_and_the_failure_names_the_shard(cluster, tiny_models, prompts, tmp_path, capsys):
    always = {"actor": "generator", "method": "open", "call": 1, "action": "exit", "times": None}
    rc = main(args(tiny_models, prompts, tmp_path / "out", "--set", "runtime.max_attempts=2",
                   "--set", "runtime.batches_in_flight=1", faults=[always]))
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: shard(s) train-0000") and "failed after 2 attempts" in err[-1]
    assert "generator 0 actor died during open()" in err[-1]
    assert not (tmp_path / "out" / "_SUCCESS").exists() and not list((tmp_path / "out").glob("part-*"))


def test_build_metrics_are_ray_metrics_on_a_cluster(cluster):
    from pipeline.observability import COUNTERS, GAUGES, BuildMetrics

    metrics = BuildMetrics()
    assert set(metrics._ray) == set(COUNTERS) | set(GAUGES)
    metrics.prompt_done(True, generated=30, bon_equivalent=50)
    metrics.actor_restarted(2)
    assert (metrics.totals["pairs"], metrics.totals["tokens_generated"], metrics.totals["tokens_saved"],
            metrics.totals["actor_restarts"]) == (1, 30, 20, 2)


def test_sigkill_of_the_driver_leaves_no_half_written_shard_and_the_rerun_resumes(tiny_models, prompts, reference,
                                                                                  tmp_path):
    out = tmp_path / "out"
    slow = {"actor": "reward", "method": "extend", "action": "delay", "seconds": 0.4, "times": None}
    proc = subprocess.Popen([sys.executable, "-m", "jobs.build_dataset",
                             # one batch at a time, so shards commit one by one (with 16 batches in
                             # flight all three can commit within one poll)
                             *args(tiny_models, prompts, out, "--set", "runtime.local=true",
                                   "--set", "runtime.batches_in_flight=1", faults=[slow])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not list((out / "_markers").glob("part-*.json")) and time.monotonic() < deadline:
            assert proc.poll() is None, "the build ended before it could be killed"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    markers = sorted(p.name for p in (out / "_markers").glob("part-*.json"))
    assert 1 <= len(markers) < 3, markers
    parts = sorted(out.glob("train-*.parquet"))  # whatever is visible is whole: every committed shard, readable
    assert len(parts) >= len(markers)
    assert all({"prompt", "chosen", "rejected"} <= set(pq.read_table(part).column_names) for part in parts)
    assert not (out / "_SUCCESS").exists()
    assert main(args(tiny_models, prompts, out, "--set", "runtime.local=true")) == 0
    manifest = json.loads((out / "_manifest.json").read_text())
    assert len(manifest["shards_skipped"]) == len(markers) and manifest["pairs"] == len(GOOD_PROMPTS)
    assert_exactly_once(out, reference)


def test_s3_settings_reach_ray_workers_and_an_s3_build_resumes(cluster, tiny_models, prompts, reference, tmp_path):
    import s3fs

    from actors import start_workers
    from pipeline.config import load_config

    with moto_s3() as endpoint:
        options = {"endpoint_url": endpoint, "key": "k", "secret": "s", "client_kwargs": {"region_name": "us-east-1"}}
        fs = s3fs.S3FileSystem(**options)
        fs.put(str(prompts), "bucket/in/p.jsonl")
        storage = ["--set", f"data.storage_options={json.dumps(options)}"]

        # Workers get the endpoint through runtime_env, never a credential (issue 27: secrets travelled
        # there and Ray logs runtime_envs in plain text); the driver alone reads and writes S3.
        config = load_config("configs/demo.yaml", [f"models.generator={tiny_models['generator']}",
                                                   f"models.reward={tiny_models['reward']}",
                                                   f"data.storage_options={json.dumps(options)}"])
        workers = start_workers(config)
        try:
            def worker_env(actor):
                import os

                return os.environ.get("AWS_ENDPOINT_URL"), os.environ.get("AWS_SECRET_ACCESS_KEY")

            seen = ray.get(workers.handles[0].__ray_call__.remote(worker_env))
        finally:
            workers.shutdown()
        assert seen[0] == endpoint and seen[1] != options["secret"]  # storage_options never reach a worker

        out = "s3://bucket/out/run"
        assert main(args(tiny_models, "s3://bucket/in/p.jsonl", out, *storage)) == 0
        fs.rm("bucket/out/run/_markers/part-00001.json")  # a run killed between data and marker
        fs.rm("bucket/out/run/_SUCCESS")
        assert main(args(tiny_models, "s3://bucket/in/p.jsonl", out, *storage)) == 0
        fs.invalidate_cache()
        manifest = json.loads(fs.cat("bucket/out/run/_manifest.json"))
        assert manifest["shards_written"] == [1] and manifest["shards_skipped"] == [0, 2]
        local = tmp_path / "copy"
        fs.get("bucket/out/run/", str(local), recursive=True)
        assert_exactly_once(local, reference)
